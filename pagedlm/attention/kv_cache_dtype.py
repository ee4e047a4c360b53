"""`kv_cache_dtype` as vLLM accepts it: "auto" stores K/V in the model dtype; "fp8" (= "fp8_e4m3")
and "fp8_e5m2" store them as torch.float8_e4m3fn / float8_e5m2, half the memory of bf16.

fp8 values carry a per-tensor scale per layer, as vLLM's k_scale / v_scale (default 1.0):
stored = saturate(x / scale), read = stored * scale. Writes saturate at the format's largest
finite value, so the cache never holds inf or NaN. With `calculate_kv_scales` (vLLM's option)
each layer sets its scales once, from the first batch: max|k| / 200 and max|v| / 100 (vLLM's
K_SCALE_CONSTANT / V_SCALE_CONSTANT), which keeps small-valued tensors out of fp8's subnormals.
"""

from __future__ import annotations

import torch

FP8_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}."
        )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache tensors are allocated in."""
    check_kv_cache_dtype(kv_cache_dtype)
    return FP8_KV_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def calculate_kv_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """(k_scale, v_scale) from one batch's keys and values (1.0 for an all-zero tensor)."""
    k_max, v_max = float(key.abs().max()), float(value.abs().max())
    return (k_max / K_SCALE_CONSTANT or 1.0), (v_max / V_SCALE_CONSTANT or 1.0)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in fp32, saturated to dtype's finite range, as dtype."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 cache values -> dtype (x * scale in fp32, as the C kernels do); others unchanged."""
    if not is_fp8(x.dtype):
        return x
    return (x.float() * scale).to(dtype)
