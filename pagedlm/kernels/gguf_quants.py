"""Vectorized dequantization of GGML tensors (as stored in GGUF files) with torch.

Entry point: :func:`dequantize`. A tensor's raw bytes are viewed as ``[num_blocks, type_size]``
uint8 and every block is decoded at once with tensor ops (the work is split into chunks of a few
thousand blocks only to keep temporaries cache-sized; there is no per-block Python loop). The
arithmetic mirrors ggml's reference (and ``gguf.quants``) operation by operation in float32, so
the float32 result is bit-identical to ``gguf.quants.dequantize``.

Shapes: GGUF stores a tensor's dimensions as ``ne`` (fastest-varying first); ``dequantize`` wants
the logical PyTorch shape, i.e. ``tuple(reversed(ne))`` -- ``(rows, cols)`` for a matrix.
``gguf.GGUFReader``'s ``tensor.shape`` is in ``ne`` order; its ``tensor.data`` is shaped
``reversed(ne)`` for F16/F32 (typed arrays) but, for every other type including BF16, is a uint8
array of shape ``(*reversed(ne)[:-1], bytes_per_row)``. Both forms are accepted (only the bytes
matter; ``raw`` is flattened).

The per-type block decoders and the block layouts are in :mod:`gguf_blocks`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedlm.kernels.gguf_blocks import BLOCK_DECODERS

__all__ = ["SUPPORTED_TYPES", "dequantize"]

_T = GGMLQuantizationType
# Values decoded per step. Per-block scales are computed for the whole tensor at once; the
# bulk (quants -> float32) runs in chunks so temporaries stay in L2 and per-op overhead stays
# small next to the work.
_CHUNK_VALUES = 1 << 18


_PLAIN: dict[GGMLQuantizationType, torch.dtype] = {
    _T.F32: torch.float32,
    _T.F16: torch.float16,
    _T.BF16: torch.bfloat16,
}

#: Types stored as plain floats (no blocks to keep: they decode to dense tensors).
PLAIN_TYPES: frozenset[GGMLQuantizationType] = frozenset(_PLAIN)

#: GGML types :func:`dequantize` handles.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_PLAIN) | frozenset(BLOCK_DECODERS)


def _supported_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))


def _as_qtype(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    try:
        t = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise NotImplementedError(
            f"Unknown GGML type {qtype!r}; supported types: {_supported_names()}"
        ) from None
    if t not in SUPPORTED_TYPES:
        raise NotImplementedError(
            f"Dequantizing GGML type {t.name} is not supported; "
            f"supported types: {_supported_names()}"
        )
    return t


def _as_bytes(raw: np.ndarray | torch.Tensor | bytes) -> torch.Tensor:
    """Flat uint8 CPU torch view of ``raw``'s bytes (no copy when it is contiguous)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().cpu().contiguous().reshape(-1)
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    with warnings.catch_warnings():
        # GGUFReader hands out read-only memmaps; we only ever read from them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def dequantize(
    raw: np.ndarray | torch.Tensor | bytes,
    qtype: int | GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode a GGML tensor's raw bytes into a torch tensor of ``shape`` and ``dtype``.

    Args:
        raw: the tensor's bytes, e.g. ``GGUFReader(...).tensors[i].data`` (uint8 for quantized
            types and BF16, float16/float32 arrays for F16/F32; any dtype and shape is read as
            its bytes in C order). numpy arrays, read-only memmaps included, and CPU tensors
            are not copied before decoding.
        qtype: the GGML type (``tensor.tensor_type``), as an enum member or int.
        shape: the logical shape in PyTorch order, i.e. ``tuple(reversed(ne))`` where ``ne`` is
            GGUF's dimension list (``GGUFReader``'s ``tensor.shape``); e.g. ``(rows, cols)``.
            Its last dimension (``ne[0]``) must be a whole number of blocks, as in ggml.
        dtype: result dtype. Values are computed in float32 (bit-identical to
            ``gguf.quants.dequantize``) and then cast.

    Returns:
        A new contiguous CPU tensor (never a view of ``raw``), so the source can be released.
        Quantized types are decoded in the calling thread alone (see ``_one_thread``); to use
        several cores, decode different tensors from several threads.

    Raises:
        NotImplementedError: ``qtype`` is not in :data:`SUPPORTED_TYPES`.
        ValueError: ``shape`` does not fit ``qtype``'s blocks or the byte count.
    """
    t = _as_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    block_size, type_size = GGML_QUANT_SIZES[t]
    if any(s < 0 for s in shape) or (shape and shape[-1] % block_size):
        raise ValueError(
            f"{t.name} tensor shape {shape}: the last dimension (GGUF ne[0]) must be a multiple "
            f"of the {block_size}-value block; pass the PyTorch-order shape, reversed(ne)"
        )
    data = _as_bytes(raw)
    if data.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{t.name} tensor of shape {shape} takes {numel // block_size * type_size} bytes "
            f"({block_size} values per {type_size}-byte block), got {data.numel()}"
        )

    if t in _PLAIN:
        return _empty(shape, dtype).copy_(data.view(_PLAIN[t]).view(shape))

    n_blocks = numel // block_size
    out = _empty((n_blocks, block_size), dtype)
    if n_blocks:
        with _one_thread():
            _decode(t, data.view(n_blocks, type_size), out, dtype)
    return out.view(shape)


def _decode(
    t: GGMLQuantizationType, blocks: torch.Tensor, out: torch.Tensor, dtype: torch.dtype
) -> None:
    n_blocks, block_size = out.shape
    body = BLOCK_DECODERS[t](blocks)
    step = max(1, _CHUNK_VALUES // block_size)
    # float32 is written in place; other dtypes go through a float32 scratch buffer.
    scratch = None if dtype == torch.float32 else torch.empty(min(step, n_blocks), block_size)
    for start in range(0, n_blocks, step):
        sl = slice(start, min(start + step, n_blocks))
        if scratch is None:
            body(sl, out[sl])
        else:
            o = scratch[: sl.stop - start]
            body(sl, o)
            out[sl].copy_(o)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops in the calling thread only, for the duration of the block.

    The decode is a stream of short ops; with intra-op threads each one ends in a barrier, and
    when the cores are busy with other work every barrier waits for a descheduled thread (we
    measured 10-60x slowdowns on 2 shared cores). torch's thread count is per calling thread
    (OpenMP), so other threads are not affected.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialized tensor backed by numpy memory.

    numpy asks the kernel for transparent huge pages on large allocations and torch's CPU
    allocator does not; first-touching a fresh multi-MB output costs about half as much then.
    """
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < 1 << 22:  # below numpy's huge-page threshold: nothing to gain
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
    return buf.view(dtype).view(shape)
