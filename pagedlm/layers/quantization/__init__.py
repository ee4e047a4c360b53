"""Linear methods: how a linear layer holds its weight and computes x W^T (vLLM's
`quant_method`). `LinearBase` asks `get_linear_method()` for one when it is built; the model
loader sets the method for the whole model with `set_quantization` around construction.

- None: `UnquantizedLinearMethod` (dense, oneDNN-prepacked, small-batch kernels).
- "gguf": `GGUFLinearMethod` -- GGUF blocks kept packed, integer kernels (GGUF files only).
- "int8": `Int8LinearMethod` -- W8A8: a dense checkpoint quantized per channel at load.
- "compressed-tensors": `CompressedTensorsW8A8LinearMethod` -- W8A8 int8 checkpoints
  (`compressed_tensors.check_config` says which such checkpoints load).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedlm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod

QUANTIZATION_METHODS = ("gguf", "int8", "compressed-tensors")
_current: str | None = None


@contextmanager
def set_quantization(method: str | None) -> Iterator[None]:
    """Layers built inside this block use `method` (None: unquantized)."""
    global _current
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={method!r} is not supported; supported: "
            f"{', '.join(QUANTIZATION_METHODS)} (or None)."
        )
    previous, _current = _current, method
    try:
        yield
    finally:
        _current = previous


def current_quantization() -> str | None:
    return _current


def get_linear_method() -> LinearMethodBase:
    """A fresh method object for a layer being built under the current quantization."""
    if _current == "gguf":
        from pagedlm.layers.quantization.gguf import GGUFLinearMethod

        return GGUFLinearMethod()
    if _current == "int8":
        from pagedlm.layers.quantization.int8 import Int8LinearMethod

        return Int8LinearMethod()
    if _current == "compressed-tensors":
        from pagedlm.layers.quantization.int8 import CompressedTensorsW8A8LinearMethod

        return CompressedTensorsW8A8LinearMethod()
    return UnquantizedLinearMethod()


__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethodBase",
    "UnquantizedLinearMethod",
    "current_quantization",
    "get_linear_method",
    "set_quantization",
]
