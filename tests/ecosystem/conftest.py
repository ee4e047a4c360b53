"""The vllm alias installed into a temporary target, and a runner for client code using it.

Client code runs in a subprocess with PYTHONPATH=<alias target>:<repository root>, so the test
process itself never imports `vllm` and nothing is installed into the virtual environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def alias_target(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("vllm-alias")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO / "compat" / "vllm-alias"),
        ],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def run_client(alias_target):
    """run_client(code, timeout=...) -> CompletedProcess; raises with its output if it failed."""

    def run(code: str | Path, timeout: float = 600, cwd: Path | None = None, args=()) -> str:
        """Run `code` (source text, or a script Path) with the alias importable; its stdout."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(alias_target), str(REPO)])
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")  # everything the clients load is local
        env.setdefault("HF_DATASETS_OFFLINE", "1")
        proc = subprocess.run(
            [sys.executable, *_source(code), *map(str, args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"client exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                f"--- stderr\n{proc.stderr[-8000:]}"
            )
        return proc.stdout

    return run


def _source(code: str | Path) -> list[str]:
    return [str(code)] if isinstance(code, Path) else ["-c", textwrap.dedent(code)]


def result_line(stdout: str) -> object:
    """The JSON after the last 'RESULT ' line of a client's output."""
    import json

    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1][len("RESULT ") :])
