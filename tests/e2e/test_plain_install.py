"""`pip install pagedlm` with no extras starts an engine and generates.

A fresh virtual environment gets this checkout with its declared dependencies only (torch
pinned to the CPU build, as the project pins it), then runs a greedy request on a tiny Hugging
Face directory through the uni and mp executors; the tokens must equal this environment's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
from pagedlm import LLM, SamplingParams

if __name__ == "__main__":
    tokens = {}
    for backend in ("uni", "mp"):
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=64,
                  distributed_executor_backend=backend)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
        tokens[backend] = list(out[0].outputs[0].token_ids)
        llm.llm_engine.shutdown()
    print(json.dumps(tokens))
"""


@pytest.mark.slow
def test_plain_install_starts_an_engine(tiny_qwen2, tmp_path) -> None:
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, str(ROOT)], check=True, timeout=1200)
        script = tmp_path / "run.py"
        script.write_text(_SCRIPT)
        done = subprocess.run(
            [str(venv / "bin" / "python"), str(script), str(tiny_qwen2)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # not the checkout: the installed package is imported
        )
        assert done.returncode == 0, done.stderr[-4000:]
        tokens = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(venv, ignore_errors=True)
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    expected = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert tokens["uni"] == tokens["mp"] == list(expected[0].outputs[0].token_ids)
