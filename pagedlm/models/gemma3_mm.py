"""Gemma 3 with vision: the Gemma 3 text decoder fed by a SigLIP tower and projector.

An image is marked in the prompt by `<start_of_image>` and becomes, as in Hugging Face's
`Gemma3Processor`, "\\n\\n<start_of_image>" + `mm_tokens_per_image` x `<image_soft_token>` +
"<end_of_image>\\n\\n"; the soft tokens' embeddings are the encoder's rows. Inside the causal
text attention each image's soft tokens attend to each other both ways (`mm_bidirectional`:
the scheduler never cuts an image, the attention backend widens those rows' keys to the image's
end). Image embeddings are scattered after the text embeddings' sqrt(hidden) scaling, as in
transformers. Checkpoint names: `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*` (transformers 5), or `language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*` (4.x).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedlm.models.gemma3 import Gemma3ForCausalLM
from pagedlm.models.gemma3_vision import ENCODER_PREFIXES, Gemma3ImageEncoder, canonical_name
from pagedlm.models.interfaces import ModelBase
from pagedlm.multimodal.inputs import MultiModalFeatureSpec
from pagedlm.multimodal.processing import BaseMultiModalProcessor


class Gemma3MultiModalProcessor(BaseMultiModalProcessor):
    placeholder_str = "<start_of_image>"

    def __init__(self, model_config: Any, tokenizer: Any, cache: Any) -> None:
        super().__init__(model_config, tokenizer, cache)
        config = self.hf_config
        self.image_token_id = int(config.boi_token_index)
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        soft = [int(config.image_token_index)] * int(config.mm_tokens_per_image)
        self.replacement = [*newlines, self.image_token_id, *soft, int(config.eoi_token_index)]
        self.replacement += newlines
        self.embed_offset = len(newlines) + 1

    def process_image(self, image: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("do_pan_and_scan"):
            raise NotImplementedError(
                "do_pan_and_scan=True (Gemma 3's crops) is not supported by pagedlm; each image "
                "is encoded whole."
            )
        return super().process_image(image, kwargs)

    def image_replacement(self, data: dict[str, Any]) -> tuple[list[int], int, int]:
        return self.replacement, self.embed_offset, int(self.hf_config.mm_tokens_per_image)


class Gemma3ForConditionalGeneration(ModelBase):
    mm_processor_cls = Gemma3MultiModalProcessor
    mm_bidirectional = True
    packed_modules_mapping = Gemma3ForCausalLM.packed_modules_mapping

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        text_config = config.text_config
        if getattr(text_config, "tie_word_embeddings", None) is None:
            text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.vision = Gemma3ImageEncoder(config)
        self.language_model = Gemma3ForCausalLM(text_config, max_position)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output_rows is None, "supports_output_rows is False"
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.language_model.model(input_ids, positions, None, inputs_embeds)

    @property
    def text_model(self) -> ModelBase:
        return self.language_model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled text embeddings; ids past the vocabulary (image soft tokens in checkpoints
        whose image id is the vocabulary size) embed as id 0, as in transformers."""
        model = self.language_model.model
        vocab = self.language_model.config.vocab_size
        embeds = model.embed_tokens(torch.where(input_ids < vocab, input_ids, 0))
        return embeds * model.normalizer.to(embeds.dtype)

    def embed_multimodal(self, features: list[MultiModalFeatureSpec]) -> list[torch.Tensor]:
        dtype = next(self.vision.parameters()).dtype
        pixel_values = torch.cat([f.data["pixel_values"] for f in features]).to(dtype)
        return list(self.vision(pixel_values).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []
        text: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if canonical_name(name).startswith(ENCODER_PREFIXES):
                vision.append((name, tensor))
                continue
            for old, new in (
                ("model.language_model.", "model."),
                ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."),
            ):
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            text.append((name, tensor))
        self.language_model.weights_finalized = self.weights_finalized  # incremental reloads
        loaded = {f"vision.{n}" for n in self.vision.load_weights(vision)}
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        return loaded
