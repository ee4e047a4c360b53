"""Decoder models used as pooling models: last-token embedders and sequence classifiers.

`as_embedding_model(LlamaForCausalLM)` embeds with the last token's final hidden state
(normalized), as Qwen3-Embedding-style models do; `as_seq_cls_model(...)` applies the
checkpoint's `score` head to the last token (Qwen2/Llama ForSequenceClassification). Both pool
the LAST row, so their prompts may be chunked and prefix-cached (as vLLM's causal LAST
poolers) and their last layer computes that row alone (`output_rows`, step_inputs.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedlm.layers.linear import ReplicatedLinear
from pagedlm.layers.pooler import ClassifierPooler, EmbeddingPooler
from pagedlm.models.interfaces import ModelBase
from pagedlm.models.weight_utils import load_packed_weights


def _with_model_prefix(weights: Iterable[tuple[str, torch.Tensor]], keep: tuple[str, ...]):
    """Checkpoints saved from the bare decoder (`Qwen3Model`) have no `model.` prefix."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        if not name.startswith(("model.", *keep)):
            name = "model." + name
        yield name, tensor


class _PooledDecoder(ModelBase):
    """A causal decoder's `model` (its final hidden states) under a LAST pooler."""

    model: nn.Module
    # a prompt's last row sees all of it: prompts may be chunked and start from cached blocks
    supports_chunked_pooling = True
    is_pooling_model = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_rows is None:  # a registered decoder may not take output rows
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, output_rows)


def as_embedding_model(causal_cls: type[ModelBase]) -> type[ModelBase]:
    class EmbeddingModel(_PooledDecoder):
        supports_output_rows = causal_cls.supports_output_rows

        def __init__(self, config: Any, max_position: int, model_dir: str | None = None):
            super().__init__()
            self.config = config
            self.model = causal_cls.model_cls(config, max_position)
            self.pooler = EmbeddingPooler("LAST", normalize=True)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_packed_weights(
                self,
                _with_model_prefix(weights, ()),
                causal_cls.stacked_params_mapping,
                ("rotary_emb.inv_freq",),
            )

    EmbeddingModel.__name__ = causal_cls.__name__.replace("ForCausalLM", "EmbeddingModel")
    return EmbeddingModel


def as_seq_cls_model(causal_cls: type[ModelBase]) -> type[ModelBase]:
    class ForSequenceClassification(_PooledDecoder):
        supports_output_rows = causal_cls.supports_output_rows

        def __init__(self, config: Any, max_position: int, model_dir: str | None = None):
            super().__init__()
            self.config = config
            self.model = causal_cls.model_cls(config, max_position)
            self.num_labels = int(getattr(config, "num_labels", 1))
            self.score = ReplicatedLinear(config.hidden_size, self.num_labels, bias=False)
            self.pooler = ClassifierPooler("LAST", self.score, self.num_labels)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_packed_weights(
                self,
                _with_model_prefix(weights, ("score.",)),
                causal_cls.stacked_params_mapping,
                ("rotary_emb.inv_freq",),
            )

    name = causal_cls.__name__.replace("ForCausalLM", "ForSequenceClassification")
    ForSequenceClassification.__name__ = name
    return ForSequenceClassification
