"""GGUF linear method: weights stay in their quantized blocks (repacked, `gguf_pack`).

The GGUF loader yields a `GGUFRawTensor` (raw blocks + type + logical shape) for every linear
weight whose type has a packed kernel, and dequantized tensors for the rest. A layer's
tensor-parallel `weight_loader` slices either kind (rows, or whole blocks of columns) and
"copies" it into a `_ShardSink`, which records (row offset, tensor) for the method. After
loading, consecutive shards of one GGML type are merged into one packed group (fused q/k/v may
mix types: Qwen2's v_proj is often Q8_0 next to Q5_0 q/k), and `apply` computes each group:

- up to `GEMV_ROWS` rows: the integer GEMV (`kernels.gguf.gguf_gemv`);
- more rows (prefill, large decode batches): the integer GEMM (`kernels.gguf.gguf_gemm`);
- on AVX2 (no VNNI, so no GEMM): the AVX2 GEMV for every batch (as fast as oneDNN's fp32
  GEMM on prefill-sized batches, 3-8x faster below 32 rows, on Zen 2);
- with neither: tiles of dequantized rows through oneDNN (F.linear);
- without C kernels: the PyTorch twin (`dequantize_packed`) then F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pagedlm.kernels import gguf as gguf_kernels
from pagedlm.kernels.gguf_pack import (
    PackedGGUFWeight,
    can_pack,
    dequantize_packed,
    pack_gguf,
    packed_rows,
)
from pagedlm.kernels.gguf_quants import dequantize
from pagedlm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod
from pagedlm.utils import release_mapped_pages

GEMV_ROWS = 4  # integer GEMV up to here, the integer GEMM past it (crossover 4-8 rows)
_TILE_VALUES = 1 << 20  # weight values dequantized per prefill tile (2 MB in bf16)


class GGUFRawTensor:
    """A GGUF matrix as raw blocks: `data` uint8 [rows, bytes_per_row], `shape` (rows, cols).

    `narrow` slices rows, or columns in whole blocks, the way the tensor-parallel loaders do.
    `file_backed`: `data` views a read-only mapping of the GGUF file, whose pages are dropped
    from this process once the packed copy is made (`release`).
    """

    def __init__(
        self, data: torch.Tensor, ggml_type: int, shape: tuple[int, int], file_backed: bool = False
    ) -> None:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        rows, cols = shape
        if data.dtype != torch.uint8 or tuple(data.shape) != (rows, cols // block * type_size):
            raise ValueError(f"GGUF raw tensor {tuple(data.shape)} does not hold {shape}")
        self.data, self.ggml_type, self._shape = data, int(ggml_type), (rows, cols)
        self.file_backed = file_backed

    def release(self) -> None:
        """After packing: the file's pages this view read leave this process's memory."""
        if self.file_backed:
            storage = self.data.untyped_storage()
            release_mapped_pages(storage.data_ptr(), storage.nbytes())

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFRawTensor:
        rows, cols = self._shape
        if dim == 0:
            data = self.data.narrow(0, start, length)
            return GGUFRawTensor(data, self.ggml_type, (length, cols), self.file_backed)
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        if start % block or length % block:
            raise ValueError(
                f"cannot split a GGUF tensor's columns at {start}:{start + length}: not whole "
                f"{block}-value blocks (tensor_parallel_size too large for this model?)"
            )
        sliced = self.data.narrow(1, start // block * type_size, length // block * type_size)
        return GGUFRawTensor(sliced, self.ggml_type, (rows, length), self.file_backed)


class _ShardSink:
    """Stands in for a layer's weight during loading: `narrow(0, ...)` and `copy_` record
    where each (raw or dense) checkpoint piece goes, as rows of the output."""

    def __init__(self, shards: list, rows: int, cols: int, offset: int = 0) -> None:
        self.shards, self.rows, self.cols, self.offset = shards, rows, cols, offset

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def data(self) -> _ShardSink:
        return self

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> _ShardSink:
        if dim != 0:
            raise ValueError("GGUF layers take column slices of the checkpoint, not the param")
        return _ShardSink(self.shards, length, self.cols, self.offset + start)

    def copy_(self, src: GGUFRawTensor | torch.Tensor) -> None:
        self.shards.append((self.offset, src))


@dataclass
class PackedGroup:
    """Output rows [offset, offset + rows) computed from one packed weight or a dense one."""

    offset: int
    rows: int
    packed: PackedGGUFWeight | None
    dense: torch.Tensor | None


class GGUFEmbeddingMethod:
    """An embedding table kept as its GGUF blocks (as llama.cpp keeps it): a lookup decodes
    just the rows it reads, to the values decoding the whole table would give (the decode is
    per block). A tied head packs the table after loading, and lookups move to its packed
    weight (`PackedEmbeddingMethod`)."""

    def load(self, layer: nn.Module, raw: GGUFRawTensor) -> None:
        """This rank's rows of `raw`, left in the file's mapping as llama.cpp leaves them, so
        only the pages of rows looked up become resident (the layer then drops its dense
        parameter: `VocabParallelEmbedding.look_up_with`); a tied head packs them and
        releases their pages."""
        rows = min(layer.weight.shape[0], raw.shape[0] - layer.vocab_start)
        layer.gguf_table = raw.narrow(0, layer.vocab_start, rows) if layer.tp_size > 1 else raw

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        table = layer.gguf_table
        flat = ids.reshape(-1).clamp(max=table.shape[0] - 1)  # TP padding rows: masked later
        rows = table.data.index_select(0, flat)
        out = dequantize(rows, table.ggml_type, (flat.shape[0], table.shape[1]), layer.weight.dtype)
        return out.view(*ids.shape, table.shape[1])


class PackedEmbeddingMethod:
    """Lookups of an embedding tied to a packed LM head (int8, or a GGUF table's blocks): each
    row decoded from the head's packed weight (`packed_rows`), so the table is held once."""

    def __init__(self, packed: PackedGGUFWeight) -> None:
        self.packed = packed

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).clamp(max=self.packed.n - 1)  # TP padding rows: masked later
        rows = packed_rows(self.packed, flat).to(layer.weight.dtype)
        return rows.view(*ids.shape, rows.shape[-1])


class PackedLinearMethod(LinearMethodBase):
    """Computes from `layer.packed_groups` (set after loading): output rows each from a
    packed weight (`gguf_linear`) or a dense one. GGUF files and the int8 methods."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        outs = []
        for g in layer.packed_groups:
            b = None if bias is None else bias[g.offset : g.offset + g.rows]
            if g.packed is not None:
                outs.append(gguf_linear(x2, g.packed, b))
            else:
                outs.append(F.linear(x2, g.dense, b))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Prefill-sized batches of one packed int8 weight on AMX-INT8: the GEMM applies the
        activation to each row of its sums, so the [M, 2 * d] product is never written."""
        w = silu_and_mul_weight(layer, x.numel() // x.shape[-1])
        if w is None or x.dtype not in (torch.bfloat16, torch.float32):
            return None
        b = None if bias is None else bias.to(x.dtype)
        y = gguf_kernels.int8_gemm_silu_and_mul(x.reshape(-1, x.shape[-1]), w, b)
        return None if y is None else y.view(*x.shape[:-1], y.shape[-1])


class GGUFLinearMethod(PackedLinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        # a meta placeholder: named (so the loader finds it), shaped, and holding nothing
        placeholder = torch.empty(layer.output_size, layer.input_size, device="meta")
        layer.weight = nn.Parameter(placeholder, requires_grad=False)
        layer.gguf_shards = []
        sink = _ShardSink(layer.gguf_shards, layer.output_size, layer.input_size)

        def weight_loader(param, loaded_weight, shard_id=None) -> None:
            layer.weight_loader(sink, loaded_weight, shard_id)

        layer.weight.weight_loader = weight_loader
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = sorted(layer.gguf_shards, key=lambda s: s[0])
        # emptied, not just detached: the loader's sink (kept by finalize_weights' record of
        # loaders) holds this list, and its raw views hold the file's mapping in memory
        layer.gguf_shards.clear()
        del layer.gguf_shards
        groups = _merge(shards, layer.output_size, layer.input_size, layer.params_dtype)
        if all(g.dense is not None for g in groups):  # nothing packed: the unquantized path
            dense = torch.cat([g.dense for g in groups]) if len(groups) > 1 else groups[0].dense
            layer.weight = nn.Parameter(dense, requires_grad=False)
            layer.quant_method = UnquantizedLinearMethod()
            layer.quant_method.process_weights_after_loading(layer)
            return
        layer.weight = None
        layer.packed_groups = groups


def _merge(shards: list, rows: int, cols: int, dtype: torch.dtype) -> list[PackedGroup]:
    """Shards (offset, tensor) sorted by offset -> groups; adjacent shards of one GGML type
    become one packed weight. Every output row must be covered exactly once."""
    groups: list[PackedGroup] = []
    pending: list[tuple[int, GGUFRawTensor]] = []

    def flush() -> None:
        if not pending:
            return
        offset, first = pending[0]
        rows = sum(t.shape[0] for _, t in pending)
        if len(pending) > 1:  # e.g. fused q/k/v of one type: their pages go once copied
            data, release = torch.cat([t.data for _, t in pending]), False
            for _, raw in pending:
                raw.release()
        else:  # the packer drops the file's pages chunk by chunk as it reads them
            data, release = first.data, first.file_backed
        packed = pack_gguf(data, first.ggml_type, (rows, first.shape[1]), release_read=release)
        groups.append(PackedGroup(offset, rows, packed, None))
        pending.clear()

    at = 0
    for offset, tensor in shards:
        if offset != at:
            raise ValueError(f"GGUF layer of {rows} rows: rows {at}..{offset} were not loaded")
        if isinstance(tensor, GGUFRawTensor) and not can_pack(tensor.ggml_type, tensor.shape):
            # e.g. a tensor-parallel column shard narrower than a 64-value chunk
            raw, tensor = tensor, dequantize(tensor.data, tensor.ggml_type, tuple(tensor.shape))
            raw.release()
        is_raw = isinstance(tensor, GGUFRawTensor)
        if pending and (not is_raw or pending[-1][1].ggml_type != tensor.ggml_type):
            flush()
        if is_raw:
            pending.append((offset, tensor))
        else:
            flush()
            dense = tensor.to(dtype).contiguous()
            groups.append(PackedGroup(offset, dense.shape[0], None, dense))
        at = offset + tensor.shape[0]
    flush()
    if at != rows:
        raise ValueError(f"GGUF layer of {rows} rows: rows {at}..{rows} were not loaded")
    merged: list[PackedGroup] = []  # adjacent dense groups into one
    for g in groups:
        if merged and g.dense is not None and merged[-1].dense is not None:
            last = merged[-1]
            last.dense = torch.cat([last.dense, g.dense])
            last.rows += g.rows
        else:
            merged.append(g)
    return merged


def silu_and_mul_weight(layer: nn.Module, rows: int) -> PackedGGUFWeight | None:
    """The layer's one packed weight where its GEMM computes silu(gate) * up in one pass at
    `rows` rows (per-channel int8 on AMX-INT8, batches past the GEMV's), else None: the
    MLP's and the decode plan's condition."""
    groups = layer.__dict__.get("packed_groups") or ()
    if len(groups) != 1 or groups[0].packed is None or takes_gemv(rows):
        return None
    return groups[0].packed if gguf_kernels.fuses_silu_and_mul(groups[0].packed) else None


def takes_gemv(rows: int) -> bool:
    """Whether `gguf_linear` computes `rows` rows with the integer GEMV: decode-sized batches,
    and every batch on AVX2 (where the GEMM is not compiled in)."""
    return rows <= GEMV_ROWS or gguf_kernels.gguf_isa() == "avx2"


def gguf_linear(
    x: torch.Tensor, w: PackedGGUFWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) in x's dtype: integer GEMV for decode-sized M (every M on
    AVX2), integer GEMM past it, dequantized tiles through oneDNN where neither integer
    kernel runs, the PyTorch twin without C."""
    native = x.dtype in (torch.bfloat16, torch.float32)
    if native:
        b = None if bias is None else bias.to(x.dtype)
        if takes_gemv(x.shape[0]):
            y = gguf_kernels.gguf_gemv(x, w, b)
        else:
            y = gguf_kernels.gguf_gemm(x, w, b)
        if y is not None:
            return y
    n, k = w.shape
    tile = max(16, _TILE_VALUES // k)
    outs = []
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        wt = gguf_kernels.gguf_dequantize_rows(w, n0, n1, x.dtype) if native else None
        if wt is None:
            wt = dequantize_packed(w, slice(n0, n1), x.dtype)
        outs.append(F.linear(x, wt, None if bias is None else bias[n0:n1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
