"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE, fed by a windowed vision transformer.

An image becomes `t*h*w / merge**2` `<|image_pad|>` tokens (the image processor's grid, merged
2x2 by the patch merger); their embeddings are the vision encoder's output rows, in order.
Positions are three per token (time, height, width): text tokens count up on all three, an
image's tokens take its grid coordinates offset by the position where it starts, and the text
after it continues from past the image's largest coordinate (Hugging Face's `get_rope_index`).
Checkpoint names: `model.language_model.*` / `model.visual.*` (transformers 5) or `model.*` /
`visual.*` (4.x), and `lm_head.*`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedlm.models.interfaces import ModelBase
from pagedlm.models.qwen2 import Qwen2ForCausalLM
from pagedlm.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from pagedlm.multimodal.inputs import MultiModalFeatureSpec
from pagedlm.multimodal.processing import BaseMultiModalProcessor


class Qwen2_5_VLMultiModalProcessor(BaseMultiModalProcessor):
    """Each `<|image_pad|>` of the prompt becomes one per merged patch of its image."""

    placeholder_str = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model_config: Any, tokenizer: Any, cache: Any) -> None:
        super().__init__(model_config, tokenizer, cache)
        self.image_token_id = int(self.hf_config.image_token_id)
        self.merge_size = int(self.hf_config.vision_config.spatial_merge_size)

    def image_replacement(self, data: dict[str, Any]) -> tuple[list[int], int, int]:
        num_embeds = int(data["image_grid_thw"].prod()) // self.merge_size**2
        return [self.image_token_id] * num_embeds, 0, num_embeds


class Qwen2_5_VLForConditionalGeneration(ModelBase):
    mm_processor_cls = Qwen2_5_VLMultiModalProcessor
    uses_mrope = True
    supports_output_rows = True
    packed_modules_mapping = Qwen2ForCausalLM.packed_modules_mapping

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        text_config = config.text_config
        if getattr(text_config, "tie_word_embeddings", None) is None:  # transformers 5 keeps
            text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.visual = Qwen2_5_VisionTransformer(config.vision_config)
        self.language_model = Qwen2ForCausalLM(text_config, max_position)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, output_rows, inputs_embeds)

    @property
    def text_model(self) -> ModelBase:
        return self.language_model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def embed_multimodal(self, features: list[MultiModalFeatureSpec]) -> list[torch.Tensor]:
        dtype = next(self.visual.parameters()).dtype
        pixel_values = torch.cat([f.data["pixel_values"] for f in features]).to(dtype)
        grid_thw = torch.cat([f.data["image_grid_thw"] for f in features])
        embeds = self.visual(pixel_values, grid_thw)
        return list(embeds.split([f.num_embeds for f in features]))

    def get_mrope_input_positions(
        self, token_ids: list[int], features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        merge = int(self.config.vision_config.spatial_merge_size)
        pieces: list[torch.Tensor] = []
        position = cursor = 0
        for feature in features:
            num_text = feature.mm_position.offset - cursor
            pieces.append(torch.arange(num_text).expand(3, -1) + position)
            position += num_text
            t, h, w = (int(x) for x in feature.data["image_grid_thw"][0])
            h, w = h // merge, w // merge
            grid = torch.stack(
                torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            )
            pieces.append(grid.reshape(3, -1) + position)
            position += max(h, w)
            cursor = feature.mm_position.end
        pieces.append(torch.arange(len(token_ids) - cursor).expand(3, -1) + position)
        positions = torch.cat(pieces, dim=1)
        return positions, int(positions.max()) + 1 - len(token_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        visual: list[tuple[str, torch.Tensor]] = []
        text: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            for prefix in ("model.visual.", "visual."):
                if name.startswith(prefix):
                    visual.append((name[len(prefix) :], tensor))
                    break
            else:
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model.") :]
                text.append((name, tensor))
        self.language_model.weights_finalized = self.weights_finalized  # incremental reloads
        loaded = {f"visual.{n}" for n in self.visual.load_weights(visual)}
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        return loaded
