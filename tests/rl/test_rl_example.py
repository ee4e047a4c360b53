"""examples/rl_rollout_loop.py runs end to end: rewards per step, committed versions, and the
engine serving exactly the trainer's weights (logprob gap at float rounding)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "backend,executor", [("ipc", "uni"), pytest.param("gloo", "mp", marks=pytest.mark.slow)]
)
def test_rl_rollout_loop_example(tiny_qwen2, backend, executor):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "rl_rollout_loop.py"),
            "--model",
            str(tiny_qwen2),
            "--steps",
            "3",
            "--backend",
            backend,
            "--executor",
            executor,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(
        r"step (\d+): mean reward ([\d.]+)  weight_version (\S+)  engine/trainer logprob gap "
        r"(\S+)",
        result.stdout,
    )
    assert [int(s) for s, *_ in lines] == [1, 2, 3]
    for step, reward, version, gap in lines:
        assert 0.0 <= float(reward) <= 1.0
        assert version == f"step-{step}"
        assert float(gap) < 1e-4
