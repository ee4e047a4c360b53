"""Paged attention on the CPU: the compiled C kernels (kernels/csrc) where they build, plain
PyTorch `scaled_dot_product_attention` otherwise (the kernels' tested twin, also the path for
dtypes the kernels do not take).

With the C kernels, decode rows go through `paged_decode_attention` (split-KV) and every
prefill chunk, cached prefix or not, through the tiled `paged_prefill_attention`, both reading
K/V from the paged cache through the block table. An fp8 cache (kv_cache_dtype.py) holds
saturate(x / scale); both paths attend its dequantized values. The PyTorch path:

Decode rows are attended in one batched call: their blocks are gathered through the block table
and padded to the longest sequence with a key mask. Each prefill chunk gets its own call; a
chunk with no cached prefix uses the fresh keys with `is_causal` (top-left = bottom-right when
q_len == kv_len), a chunk after a cached prefix gathers its blocks and uses an explicit
bottom-right causal mask. Sliding windows restrict keys to the last `window` positions.

Bidirectional spans (backend.py; Gemma 3's images): after the causal attention, the span's
query rows are attended again over every cached key before the span's end (within the sliding
window), with PyTorch SDPA.

Output rows (backend.py): `outputs` describes the requests' trailing rows as a batch of its own
whose every chunk reads the cache, so both paths attend them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

from pagedlm.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    num_leading_decodes,
)
from pagedlm.attention.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv
from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.cpu_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks_of_seq] long


@dataclass
class BidirectionalSpan:
    """Query rows [row, row + num_rows) at positions from `position` attend keys [0, end)."""

    row: int
    num_rows: int
    position: int
    end: int
    block_ids: torch.Tensor  # [num_blocks_of_seq] long


@dataclass
class FreshPrefillGroup:
    """Prefills with no cached prefix and the same length: one batched causal call."""

    length: int
    starts: list[int]
    rows: torch.Tensor | None  # [len(starts) * length] token rows, None when contiguous


def _rows(starts: list[int], length: int, device: torch.device) -> torch.Tensor | None:
    """Token rows of the group, or None when they are one contiguous run (a view suffices)."""
    if all(b - a == length for a, b in pairwise(starts)):
        return None
    base = torch.tensor(starts, dtype=torch.long, device=device)
    return (base[:, None] + torch.arange(length, device=device)[None, :]).reshape(-1)


@dataclass
class CPUAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_seq_lens: torch.Tensor | None  # [num_decodes] long
    max_decode_seq_len: int
    prefills: list[PrefillChunk]  # chunks attended from the cache (after a cached prefix)
    fresh_groups: list[FreshPrefillGroup] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=list)  # segments, for encoder attention
    # every prefill request (rows num_decode_tokens.. onwards), for the C prefill kernel
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills + 1], from row 0
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefills]
    prefill_block_table: torch.Tensor | None = None  # [num_prefills, max_blocks]
    # the output rows' attention (backend.py), every chunk read from the cache; None: all rows
    outputs: CPUAttentionMetadata | None = None
    bidirectional: list[BidirectionalSpan] = field(default_factory=list)
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_len] bool, True where a key is attended."""
        key = ("decode", window)
        if key not in self._masks:
            assert self.decode_seq_lens is not None
            pos = torch.arange(self.max_decode_seq_len, device=self.decode_seq_lens.device)
            lens = self.decode_seq_lens[:, None]
            mask = pos[None, :] < lens
            if window is not None:
                mask &= pos[None, :] >= lens - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]


def gather_kv(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    k_scale: float,
    v_scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` keys and values from the paged cache, [1, kv_heads,
    seq_len, d] each, dequantized to `dtype`."""
    block_size = kv_cache.shape[2]
    ids = block_ids[: (seq_len + block_size - 1) // block_size]
    k, v = (c[ids].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0) for c in kv_cache)
    return dequantize_kv(k, k_scale, dtype), dequantize_kv(v, v_scale, dtype)


def causal_mask(query_len: int, seq_len: int, window: int | None, device: torch.device):
    """Bottom-right aligned causal mask [query_len, seq_len] (True = attend)."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


class CPUAttentionBackend(AttentionBackend):
    """vLLM's CPU_ATTN backend. `use_c_kernel`: decode and prefill through the compiled paged
    kernels (None: when available; False: the PyTorch SDPA path)."""

    def __init__(self, use_c_kernel: bool | None = None) -> None:
        self.kernels = cpu_kernels() if use_c_kernel is not False else None
        if use_c_kernel and self.kernels is None:
            raise RuntimeError("the C attention kernels could not be built (is gcc installed?)")

    def _use_kernels(self, query: torch.Tensor) -> bool:
        return (
            self.kernels is not None
            and query.device.type == "cpu"
            and query.dtype in (torch.bfloat16, torch.float32)
        )

    def build(self, common: CommonAttentionMetadata, device: torch.device) -> CPUAttentionMetadata:
        metadata = self._build(common, device, fresh_keys=True)
        spans = common.bidirectional_spans
        if spans is not None:
            assert common.output_query_lens is None, "bidirectional spans need every row"
            seq_starts = common.seq_lens - np.diff(common.query_start_loc)
            for request, row, num_rows, end in spans.tolist():
                position = int(seq_starts[request]) + row - int(common.query_start_loc[request])
                block_ids = torch.from_numpy(common.block_table[request]).to(device)
                span = BidirectionalSpan(row, num_rows, position, end, block_ids)
                metadata.bidirectional.append(span)
        lens = common.output_query_lens
        if lens is not None:
            kept = np.flatnonzero(lens)  # requests with output rows, in batch order
            query_start_loc = np.zeros(len(kept) + 1, dtype=np.int64)
            np.cumsum(lens[kept], out=query_start_loc[1:])
            outputs = CommonAttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=common.seq_lens[kept],
                block_table=common.block_table[kept],
                slot_mapping=np.empty(0, dtype=np.int64),  # nothing to store
                num_decodes=num_leading_decodes(lens[kept]),  # to the decode kernel
            )
            metadata.outputs = self._build(outputs, device, fresh_keys=False)
        return metadata

    def _build(
        self, common: CommonAttentionMetadata, device: torch.device, fresh_keys: bool
    ) -> CPUAttentionMetadata:
        """`fresh_keys`: prefills with no cached prefix may attend the step's keys directly
        (PyTorch path); False for the output rows, whose keys are not passed."""
        qsl, seq_lens, table = common.query_start_loc, common.seq_lens, common.block_table
        nd = common.num_decodes
        decode_table = decode_lens = None
        max_decode = 0
        if nd:
            max_decode = int(seq_lens[:nd].max())
            decode_lens = torch.from_numpy(seq_lens[:nd]).to(device)
            decode_table = torch.from_numpy(table[:nd]).to(device)
        prefills = []
        fresh: dict[int, list[int]] = {}  # query length -> starts of prefills with no prefix
        for i in range(nd, len(seq_lens)):
            start, end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(seq_lens[i])
            if fresh_keys and seq_len == end - start:
                fresh.setdefault(seq_len, []).append(start)
                continue
            prefills.append(
                PrefillChunk(start, end - start, seq_len, torch.from_numpy(table[i]).to(device))
            )
        fresh_groups = [
            FreshPrefillGroup(length, starts, _rows(starts, length, device))
            for length, starts in fresh.items()
        ]
        prefill_qsl = prefill_lens = prefill_table = None
        if nd < len(seq_lens):
            prefill_qsl = torch.from_numpy(qsl[nd:] - qsl[nd]).to(device)
            prefill_lens = torch.from_numpy(seq_lens[nd:]).to(device)
            prefill_table = torch.from_numpy(table[nd:]).to(device)
        return CPUAttentionMetadata(
            slot_mapping=torch.from_numpy(common.slot_mapping).to(device),
            num_decode_tokens=nd,
            decode_block_table=decode_table,
            decode_seq_lens=decode_lens,
            max_decode_seq_len=max_decode,
            prefills=prefills,
            fresh_groups=fresh_groups,
            query_start_loc=common.query_start_loc.tolist(),
            prefill_query_start_loc=prefill_qsl,
            prefill_seq_lens=prefill_lens,
            prefill_block_table=prefill_table,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """`k_scale`/`v_scale`: the per-tensor scales of an fp8 cache (ignored otherwise)."""
        out = self._forward_causal(
            query, key, value, kv_cache, metadata, scale, sliding_window, k_scale, v_scale
        )
        for span in metadata.bidirectional:
            out[span.row : span.row + span.num_rows] = self._attend_span(
                query, kv_cache, span, scale, sliding_window, k_scale, v_scale
            )
        return out

    @staticmethod
    def _attend_span(
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        span: BidirectionalSpan,
        scale: float,
        sliding_window: int | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """The span's rows over every cached key before its end (within the window)."""
        q = query[span.row : span.row + span.num_rows].transpose(0, 1).unsqueeze(0)
        k, v = gather_kv(kv_cache, span.block_ids, span.end, k_scale, v_scale, q.dtype)
        mask = None
        if sliding_window is not None:
            q_pos = torch.arange(span.position, span.position + span.num_rows, device=q.device)
            mask = (
                torch.arange(span.end, device=q.device)[None, :] > q_pos[:, None] - sliding_window
            )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _forward_causal(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """Write the step's keys and values to the cache, then causal attention (`forward`)."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
        flat_k = k_cache.view(-1, num_kv_heads, head_size)
        flat_v = v_cache.view(-1, num_kv_heads, head_size)
        num_tokens = metadata.slot_mapping.shape[0]
        fp8 = is_fp8(kv_cache.dtype)
        new_k, new_v = key[:num_tokens], value[:num_tokens]
        if fp8:
            new_k = quantize_kv(new_k, k_scale, kv_cache.dtype)
            new_v = quantize_kv(new_v, v_scale, kv_cache.dtype)
        slots = metadata.slot_mapping
        if self.kernels is not None and query.device.type == "cpu":
            reshape_and_cache(self.kernels, new_k, new_v, k_cache, v_cache, slots)
        elif fp8:  # torch has no fp8 index_copy_ on the CPU: copy the bytes
            flat_k.view(torch.uint8).index_copy_(0, slots, new_k.view(torch.uint8))
            flat_v.view(torch.uint8).index_copy_(0, slots, new_v.view(torch.uint8))
        else:
            flat_k.index_copy_(0, slots, new_k)
            flat_v.index_copy_(0, slots, new_v)

        if query.shape[0] < num_tokens:  # the output rows alone (the model's last layer)
            assert metadata.outputs is not None, "output rows without output_query_lens"
            metadata, num_tokens = metadata.outputs, query.shape[0]
            assert int(metadata.query_start_loc[-1]) == num_tokens, "not the output rows"
        nd = metadata.num_decode_tokens
        if nd and nd == query.shape[0]:  # decode-only: the kernel's output is the result
            return self._decode(
                query, k_cache, v_cache, metadata, scale, sliding_window, k_scale, v_scale
            )
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(
                query[:nd], k_cache, v_cache, metadata, scale, sliding_window, k_scale, v_scale
            )
        if self._use_kernels(query) and metadata.prefill_query_start_loc is not None:
            assert metadata.prefill_seq_lens is not None
            assert metadata.prefill_block_table is not None
            out[nd:num_tokens] = paged_prefill_attention(
                self.kernels,
                query[nd:num_tokens],
                k_cache,
                v_cache,
                metadata.prefill_block_table,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                scale,
                sliding_window,
                k_scale,
                v_scale,
            )
            return out
        if fp8 and metadata.fresh_groups:  # attend what the cache holds, as the kernels do
            key = dequantize_kv(new_k, k_scale, key.dtype)
            value = dequantize_kv(new_v, v_scale, value.dtype)
        for group in metadata.fresh_groups:
            self._fresh_prefills(query, key, value, out, group, scale, sliding_window)
        for chunk in metadata.prefills:
            s, n = chunk.query_start, chunk.query_len
            q = query[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
            k, v = gather_kv(kv_cache, chunk.block_ids, chunk.seq_len, k_scale, v_scale, q.dtype)
            mask = causal_mask(n, chunk.seq_len, sliding_window, query.device)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, heads, d]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        table, lens = metadata.decode_block_table, metadata.decode_seq_lens
        assert table is not None and lens is not None
        if self._use_kernels(query):
            return paged_decode_attention(
                self.kernels,
                query,
                k_cache,
                v_cache,
                table,
                lens,
                scale,
                sliding_window,
                k_scale,
                v_scale,
            )
        max_len = metadata.max_decode_seq_len
        block_size = k_cache.shape[1]
        table = table[:, : (max_len + block_size - 1) // block_size]
        # [nd, max_blocks, block_size, kv_heads, d] -> [nd, kv_heads, max_len, d]
        k = k_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2)
        v = v_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2)
        k, v = dequantize_kv(k, k_scale, query.dtype), dequantize_kv(v, v_scale, query.dtype)
        o = F.scaled_dot_product_attention(
            query.unsqueeze(2),
            k,
            v,
            attn_mask=metadata.decode_mask(sliding_window),
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    @staticmethod
    def _fresh_prefills(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        group: FreshPrefillGroup,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        """q_len == kv_len: the fresh keys are used directly, top-left causal is correct."""
        n, batch = group.length, len(group.starts)
        s = group.starts[0]
        # [batch * n, heads, d] -> [batch, heads, n, d]
        q, k, v = (
            (t[s : s + batch * n] if group.rows is None else t[group.rows])
            .view(batch, n, *t.shape[1:])
            .transpose(1, 2)
            for t in (query, key, value)
        )
        if sliding_window is None or sliding_window >= n:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = causal_mask(n, n, sliding_window, query.device)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        heads, head_size = o.shape[1], o.shape[3]
        o = o.transpose(1, 2).reshape(batch * n, heads, head_size)
        if group.rows is None:
            out[s : s + batch * n] = o
        else:
            out[group.rows] = o

    def forward_encoder(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: CPUAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Bidirectional attention within each request's tokens; no KV cache."""
        out = torch.empty_like(query)
        starts = metadata.query_start_loc
        for s, e in zip(starts[:-1], starts[1:], strict=True):
            q, k, v = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out
