"""Multimodal prompt processing: images -> the model's placeholder tokens and encoder inputs.

Each image goes through the model's own Hugging Face image processor (`AutoImageProcessor`,
its Pillow/numpy backend: torchvision is never needed), one image at a time so that each
result is cached by the image's content hash. The placeholder token that marks an image in the
prompt's token ids is then replaced by the model's token sequence for that image (the rules a
Hugging Face `*Processor` applies to text, applied to token ids here, which also serves
pre-tokenized prompts). A model supplies the rules by subclassing `BaseMultiModalProcessor`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from pagedlm.multimodal.inputs import MODALITIES, MultiModalFeatureSpec, PlaceholderRange

DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's default per modality


def hash_image(image: Any, kwargs: dict[str, Any]) -> str:
    """Content hash of a PIL image and the processor kwargs it is processed with."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size}:{sorted(kwargs.items())!r}".encode())
    h.update(np.asarray(image).tobytes())
    return h.hexdigest()


def _nbytes(data: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in data.values() if isinstance(v, torch.Tensor))


class ProcessorCache:
    """Processed items by content hash, least recently used evicted first, under a byte
    budget (`mm_processor_cache_gb`; 0 turns it off)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._bytes = 0
        self.queries = self.hits = 0

    def get(self, key: str) -> dict[str, Any] | None:
        self.queries += 1
        item = self._items.get(key)
        if item is not None:
            self.hits += 1
            self._items.move_to_end(key)
        return item

    def put(self, key: str, data: dict[str, Any]) -> None:
        size = _nbytes(data)
        if size > self.capacity_bytes or key in self._items:
            return
        while self._bytes + size > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= _nbytes(old)
        self._items[key] = data
        self._bytes += size

    def take_stats(self) -> tuple[int, int]:
        """(queries, hits) since the last call."""
        stats = (self.queries, self.hits)
        self.queries = self.hits = 0
        return stats

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)


class BaseMultiModalProcessor:
    """A model's image rules. Subclasses set `image_token_id` (the token marking an image in
    the prompt), `placeholder_str` (the text a string chat template gets per image), and
    implement `image_replacement`."""

    image_token_id: int
    placeholder_str: str

    def __init__(self, model_config: Any, tokenizer: Any, cache: ProcessorCache) -> None:
        from transformers import AutoImageProcessor

        self.model_config = model_config
        self.hf_config = model_config.hf_config
        self.tokenizer = tokenizer
        self.cache = cache
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                model_config.model_path, trust_remote_code=model_config.trust_remote_code
            )
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(
                f"Cannot load the image processor of {model_config.model} "
                f"(preprocessor_config.json): {e}"
            ) from e

    # ------------------------------------------------------------ per model
    def image_replacement(self, data: dict[str, Any]) -> tuple[list[int], int, int]:
        """(token ids replacing the image token, offset of the embeddings in them, number of
        embeddings) for one processed image."""
        raise NotImplementedError

    def process_image(self, image: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The image processor's tensors for one image."""
        try:
            out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"The image processor rejected the image: {e}") from e
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    # ------------------------------------------------------------ shared
    def apply(
        self,
        token_ids: list[int],
        images: list[Any],
        kwargs: dict[str, Any],
        uuids: list[str | None] | None = None,
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """The prompt with each image token expanded, and one feature per image (in order).
        `uuids` (multi_modal_uuids["image"]): the user's identifiers of the images, used in
        place of content hashes where given."""
        if uuids is not None and len(uuids) != len(images):
            raise ValueError(
                f"multi_modal_uuids['image'] has {len(uuids)} entries for {len(images)} images."
            )
        marks = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(marks) != len(images):
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            raise ValueError(
                f"The prompt has {len(marks)} image placeholder(s) ({token!r}) but "
                f"{len(images)} image(s) were given; put one placeholder per image in the "
                f"prompt (in chat messages, one image part per image)."
            )
        out: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        start = 0
        for i, (mark, image) in enumerate(zip(marks, images, strict=True)):
            out.extend(token_ids[start:mark])
            given = uuids[i] if uuids is not None else None
            identifier = (
                f"{given}:{sorted(kwargs.items())!r}" if given else hash_image(image, kwargs)
            )
            data = self.cache.get(identifier)
            if data is None:
                data = self.process_image(image, kwargs)
                self.cache.put(identifier, data)
            replacement, embed_offset, num_embeds = self.image_replacement(data)
            position = PlaceholderRange(len(out) + embed_offset, num_embeds)
            features.append(MultiModalFeatureSpec("image", identifier, position, data))
            out.extend(replacement)
            start = mark + 1
        out.extend(token_ids[start:])
        return out, features


def check_mm_data(mm_data: Any, limits: dict[str, int], supports_images: bool) -> list[Any]:
    """The prompt's images as PIL images, checked against the modalities pagedlm encodes and
    `limit_mm_per_prompt`."""
    from pagedlm.multimodal.image import to_pil_images

    if not isinstance(mm_data, dict):
        raise ValueError(
            f"multi_modal_data must be a dict such as {{'image': image}}, got "
            f"{type(mm_data).__name__}."
        )
    for modality in mm_data:
        if modality in ("video", "audio"):
            raise NotImplementedError(
                f"multi_modal_data[{modality!r}]: {modality} inputs are not supported by pagedlm "
                "(images are)."
            )
        if modality not in MODALITIES:
            raise ValueError(
                f"Unknown modality {modality!r} in multi_modal_data; supported: "
                f"{', '.join(MODALITIES)}."
            )
    images = to_pil_images(mm_data.get("image", []))
    if images and not supports_images:
        raise ValueError(
            "This model does not take images (it is a text-only model); remove "
            "multi_modal_data or serve a vision-language model."
        )
    limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
    if len(images) > limit:
        raise ValueError(
            f"At most {limit} image(s) may be provided in one prompt. Set "
            "`--limit-mm-per-prompt` to increase this limit."
        )
    return images
