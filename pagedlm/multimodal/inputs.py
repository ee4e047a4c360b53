"""The plain data of one multimodal item, as it crosses the engine/worker boundary.

A prompt's image becomes a run of placeholder tokens in its token ids (`PlaceholderRange`) and
a `MultiModalFeatureSpec`: the processor's tensors for that image and a content hash
(`identifier`) that keys the encoder cache and goes into the prefix-cache block hashes.
Invariant: placeholder ranges of one request are disjoint, in prompt order, and every token of
a range is replaced by one row of the encoder's output for the item.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODALITIES = ("image",)  # what pagedlm encodes; video and audio are refused by name


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions [offset, offset + length) hold the item's embeddings."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


@dataclass
class MultiModalFeatureSpec:
    """One item of a prompt: what the encoder reads (`data`: the processor's tensors for this
    item alone) and where its output goes (`mm_position`)."""

    modality: str
    identifier: str  # content hash of the item and its processor kwargs (the encoder cache key)
    mm_position: PlaceholderRange
    data: dict[str, Any]

    @property
    def num_embeds(self) -> int:
        return self.mm_position.length


def features_in(
    features: list[MultiModalFeatureSpec] | None, start: int, end: int
) -> list[tuple[int, MultiModalFeatureSpec]]:
    """(index, feature) of the features whose placeholders overlap positions [start, end)."""
    return [(i, f) for i, f in enumerate(features or ()) if f.mm_position.overlaps(start, end)]
