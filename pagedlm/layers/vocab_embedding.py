"""Token embedding and LM head (vocab-parallel names, no sharding yet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.linear import default_weight_loader, linear, prepack_weight
from pagedlm.platforms import current_platform


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = lambda p, w, shard_id=None: default_weight_loader(p, w)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding.

    A tied head keeps the embedding's dense weight for lookups and adds a prepacked copy.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tied = False
        self.logits_weight: torch.Tensor | None = None  # prepacked copy of the dense weight

    def tie_weights(self, embed: VocabParallelEmbedding) -> None:
        self.weight = embed.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        if self.tied:  # lookups need the dense weight: only add the packed copy
            self.logits_weight = current_platform.prepack_linear_weight(self.weight.data)
            return
        self.logits_weight = prepack_weight(self)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] in the model's dtype (the sampler casts)."""
        return linear(hidden_states, self.weight, None, self.logits_weight)
