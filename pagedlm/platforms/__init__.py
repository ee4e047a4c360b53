"""Device layer: one place answers which device, which dtype, how many threads, how much KV memory.

`current_platform` is chosen once at import from PAGEDLM_DEVICE: "auto" (default) is CUDA
when a GPU is visible, else the CPU; "cpu" and "cuda" choose (cuda without a GPU is an error).
"""

from __future__ import annotations

import torch

from pagedlm import envs
from pagedlm.platforms.interface import Platform


def _detect() -> Platform:
    device = envs.PAGEDLM_DEVICE
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"PAGEDLM_DEVICE={device!r}: use auto, cpu or cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("PAGEDLM_DEVICE=cuda, but torch sees no CUDA device.")
    if device != "cpu" and torch.cuda.is_available():
        from pagedlm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from pagedlm.platforms.cpu import CpuPlatform

    return CpuPlatform()


current_platform: Platform = _detect()

__all__ = ["Platform", "current_platform"]
