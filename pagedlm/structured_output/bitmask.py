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


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]``: True where the token is allowed (missing bits: not allowed).

    Bit j of int32 word w is token 32 * w + j: in little-endian bytes that is numpy's
    ``unpackbits(..., bitorder="little")`` order.
    """
    words = np.ascontiguousarray(bitmask.numpy(), dtype="<i4")
    num_rows, width = words.shape
    count = min(vocab_size, width * 32)
    allowed = np.unpackbits(words.view(np.uint8), axis=1, count=count, bitorder="little")
    if count < vocab_size:
        allowed = np.pad(allowed, ((0, 0), (0, vocab_size - count)))
    return torch.from_numpy(allowed.view(bool))


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    """Set the disallowed logits of ``rows`` to -inf, in place (any float dtype: exact)."""
    disallowed = ~unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)
    if rows == list(range(logits.shape[0])):
        return logits.masked_fill_(disallowed, float("-inf"))
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits
