"""On an AMX machine, the kernels' AVX-512 paths (what Zen 4/5 and older Xeons run) are
otherwise never exercised: rerun the kernel tests with PAGEDLM_DISABLE_AMX=1, where every
kernel takes the path it takes without AMX, against the same PyTorch twins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlm.kernels.cpu import cpu_kernels, small_batch_linear_isa

HERE = Path(__file__).parent
KERNEL_TESTS = [
    "test_paged_prefill_kernel.py",
    "test_paged_decode_kernel.py",
    "test_int8_gemm.py",
    "test_cpu_kernels.py",
]


@pytest.mark.skipif(
    cpu_kernels() is None or small_batch_linear_isa() != "amx", reason="no AMX: already run so"
)
def test_kernel_tests_pass_with_amx_disabled() -> None:
    env = dict(os.environ, PAGEDLM_DISABLE_AMX="1")
    probe = "from pagedlm.kernels.cpu import small_batch_linear_isa as f; print(f())"
    isa = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert isa.stdout.strip() != "amx", isa.stderr  # the switch took effect
    files = [str(HERE / name) for name in KERNEL_TESTS]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
