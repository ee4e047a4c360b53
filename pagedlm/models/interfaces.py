"""What the engine asks of a model class, declared once (vLLM's `models/interfaces.py`).

Every registered model class derives from `ModelBase` and overrides the capabilities it has;
the runner and `EngineArgs` read these attributes, never probe with `getattr` defaults. A new
model's author reads this class to see what to provide:

- `__init__(config, max_position, model_dir=None)`, `forward(input_ids, positions, ...)`
  returning hidden states, `load_weights(weights) -> set of loaded names`;
- a generating model: `compute_logits(hidden_states)`;
- a pooling model: `is_pooling_model = True` and a `pooler` module;
- a vision-language model: `mm_processor_cls` (its image rules, multimodal/processing.py),
  `embed_multimodal(features)`, `embed_input_ids(input_ids)`, `forward(..., inputs_embeds=)`,
  and with `uses_mrope` also `get_mrope_input_positions(token_ids, features)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedlm.multimodal.inputs import MultiModalFeatureSpec


class ModelBase(nn.Module):
    # forward(..., output_rows) computes only those rows in the last layer (step_inputs.py)
    supports_output_rows: ClassVar[bool] = False
    # a pooling model whose prompts may be chunked and start from cached blocks (LAST pooling
    # of a causal decoder); else each prompt is computed whole in one step
    supports_chunked_pooling: ClassVar[bool] = False
    # forward takes token_type_ids= (BERT segments)
    accepts_token_type_ids: ClassVar[bool] = False
    # the model's `pooler` (a module set in __init__) turns hidden states into pooled outputs
    is_pooling_model: ClassVar[bool] = False
    # (fused parameter, checkpoint name, shard id): how checkpoint tensors load into fused ones
    stacked_params_mapping: ClassVar[list[tuple[str, str, object]]] = []
    # fused module -> the checkpoint modules it holds (LoRA targets, quantization)
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    # Set by models/weight_reload.py once the weights are loaded: later loads are incremental,
    # and each committed change calls `weights_changed_callback` (the worker tells the engine).
    weights_finalized: bool = False
    weights_changed_callback: Callable[[], None] | None = None

    # images: the processor class of the model's image rules (None: a text-only model)
    mm_processor_cls: ClassVar[type | None] = None
    # three rotary position ids per token (Qwen2-VL family's M-RoPE)
    uses_mrope: ClassVar[bool] = False
    # each image's tokens attend to each other both ways (Gemma 3): an image is never split
    # across prefill chunks
    mm_bidirectional: ClassVar[bool] = False

    @property
    def text_model(self) -> nn.Module:
        """The text decoder (a vision-language model's language model): what a decode step
        of text tokens runs, the decode plan's model (llama_decode_plan.py)."""
        return self

    def embed_multimodal(self, features: list[MultiModalFeatureSpec]) -> list[torch.Tensor]:
        """One [num_embeds, hidden] tensor per feature: the vision encoder over them at once."""
        raise NotImplementedError(f"{type(self).__name__} does not take images")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not take input embeddings")

    def get_mrope_input_positions(
        self, token_ids: list[int], features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        """([3, len(token_ids)] positions, delta): a later token i has position i + delta."""
        raise NotImplementedError(f"{type(self).__name__} does not use M-RoPE")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        raise NotImplementedError(f"{type(self).__name__} must implement load_weights")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not generate tokens")
