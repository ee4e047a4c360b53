"""Worker side of structured outputs: pick the bitmask rows of the sampled batch, mask logits.

Pure torch/numpy (no xgrammar), so the worker never needs the grammar engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedlm.structured_output import GrammarOutput


def grammar_rows(
    grammar_output: GrammarOutput | None, sampling_req_ids: Sequence[str]
) -> tuple[list[int], torch.Tensor] | None:
    """(logits rows, int32 bitmask) for the sampled requests that have a bitmask row."""
    if grammar_output is None:
        return None
    row_of = {rid: i for i, rid in enumerate(sampling_req_ids)}
    rows, keep = [], []
    for i, rid in enumerate(grammar_output.req_ids):
        if rid in row_of:
            rows.append(row_of[rid])
            keep.append(i)
    if not rows:
        return None
    bitmask = grammar_output.bitmask
    if len(keep) != len(bitmask):
        bitmask = bitmask[np.asarray(keep)]
    return rows, torch.from_numpy(np.ascontiguousarray(bitmask))


_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # indexed by the allowed bit


def _unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """uint8 ``[rows, vocab_size]``, 1 where allowed. Bit j of int32 word w is token
    32 * w + j: in little-endian bytes that is numpy's ``unpackbits(bitorder="little")``."""
    words = np.ascontiguousarray(bitmask.numpy(), dtype="<i4")
    count = min(vocab_size, words.shape[1] * 32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=count, bitorder="little")
    if count < vocab_size:  # a model vocabulary wider than the bitmask: the rest is disallowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - count)))
    return bits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]``: True where the token is allowed (missing bits: not allowed)."""
    return torch.from_numpy(_unpack_bits(bitmask, vocab_size).view(bool))


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    """fp32 logits whose disallowed entries in ``rows`` are -inf; other entries unchanged.

    Adds a 0 / -inf bias (one vectorized add; about twice as fast as ``masked_fill_``). fp32
    input is modified in place; casting bf16/fp16 logits to fp32 is exact, so the argmax of
    the result is what masking in the model dtype would give.
    """
    logits = logits.float()
    bias = torch.from_numpy(_BIAS[_unpack_bits(bitmask, logits.shape[-1])]).to(logits.device)
    if rows == list(range(logits.shape[0])):
        return logits.add_(bias)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return logits.index_add_(0, index, bias)
