"""Device layer: one place answers which device, which dtype, how many threads, how much KV memory.

`current_platform` is chosen once at import: CUDA when a GPU is visible, else the CPU.
"""

from __future__ import annotations

import torch

from pagedlm.platforms.interface import Platform


def _detect() -> Platform:
    if torch.cuda.is_available():
        from pagedlm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from pagedlm.platforms.cpu import CpuPlatform

    return CpuPlatform()


current_platform: Platform = _detect()

__all__ = ["Platform", "current_platform"]
