"""The kernels' software prefetches are in the compiled library: gcc removes every call of a
function whose only effect is a prefetch (it counts __builtin_prefetch as side-effect free)
unless the function is inlined, which once silently disabled two of them."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from pagedlm.kernels.cpu import cpu_kernels


def _functions_with_prefetches() -> dict[str, int]:
    lib = cpu_kernels()
    if lib is None or shutil.which("objdump") is None:
        pytest.skip("no C kernels or no objdump")
    if not lib.gemv_bf16_avx512_compiled() or not lib.gguf_gemm_compiled():
        pytest.skip("the prefetching paths are AVX-512 (VNNI, BF16) only")
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", lib._name], capture_output=True, text=True
    ).stdout
    counts: dict[str, int] = {}
    function = ""
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            function = head.group(1)
        elif "prefetch" in line:
            counts[function] = counts.get(function, 0) + 1
    return counts


@pytest.mark.parametrize("kernel", ["paged_decode_attention", "gguf_gemm"])
def test_kernel_prefetches_are_emitted(kernel) -> None:
    counts = _functions_with_prefetches()
    assert sum(n for name, n in counts.items() if name.startswith(kernel)) > 0, counts
