"""Poolers: turn the hidden states of one prompt into an embedding or class scores.

Pooling over rows [num_tokens, hidden] of ONE request (the whole prompt is computed in one
step for pooling requests). Embeddings are truncated to `dimensions` (Matryoshka) before
normalization; classification applies softmax (sigmoid for a single label) unless
`use_activation=False`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.pooling_params import PoolingParams


def pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    if pooling_type == "CLS":
        return hidden[0]
    if pooling_type == "LAST":
        return hidden[-1]
    if pooling_type == "MEAN":
        return hidden.float().mean(0)
    if pooling_type == "ALL":
        return hidden
    raise ValueError(f"Unknown pooling type {pooling_type!r}")


class Pooler(nn.Module):
    tasks: tuple[str, ...] = ()
    pooling_type: str  # the rows `pool` reads; "LAST": the prompt's last row alone

    def forward(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        raise NotImplementedError


class EmbeddingPooler(Pooler):
    tasks = ("embed",)

    def __init__(self, pooling_type: str = "MEAN", normalize: bool = True) -> None:
        super().__init__()
        self.pooling_type = pooling_type
        self.normalize = normalize

    def forward(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        out = pool(hidden, self.pooling_type).float()
        if params.dimensions is not None:
            out = out[..., : params.dimensions]
        if self.normalize and params.use_activation is not False:
            out = F.normalize(out, p=2, dim=-1)
        return out


class ClassifierPooler(Pooler):
    """pool -> head (e.g. BERT's dense+tanh then the classifier) -> softmax / sigmoid."""

    tasks = ("classify",)

    def __init__(
        self, pooling_type: str, head: Callable[[torch.Tensor], torch.Tensor], num_labels: int
    ) -> None:
        super().__init__()
        self.pooling_type = pooling_type
        self.head = head
        self.num_labels = num_labels

    def forward(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        logits = self.head(pool(hidden, self.pooling_type)).float()
        if params.use_activation is False:
            return logits
        return logits.sigmoid() if self.num_labels == 1 else logits.softmax(-1)
