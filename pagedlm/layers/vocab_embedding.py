"""Token embedding and LM head (vocab-parallel names, no sharding yet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = lambda p, w, shard_id=None: default_weight_loader(p, w)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def tie_weights(self, embed: VocabParallelEmbedding) -> None:
        self.weight = embed.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 [num_rows, vocab]."""
        return F.linear(hidden_states, self.weight).float()
