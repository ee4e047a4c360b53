"""The worker's image path: the encoder cache, the vision encoder runs, and the step's inputs
that images change (embeddings of placeholder tokens, M-RoPE positions).

The encoder cache maps an image's identifier to its encoder output ([num_embeds, hidden]);
the scheduler says which images to encode each step and which entries to drop
(core/encoder_cache_manager.py), and the drops are applied before the encodes. Invariant: every
placeholder token a step computes has its image's output in the cache when the step runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.exceptions import blame_request
from pagedlm.models.interfaces import ModelBase
from pagedlm.multimodal.inputs import MultiModalFeatureSpec, features_in
from pagedlm.worker.input_batch import CachedRequestState, InputBatch
from pagedlm.worker.step_inputs import StepInputs


class MultiModalRunner:
    def __init__(self, model: ModelBase) -> None:
        self.model = model
        self.encoder_cache: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget every encoder output (after a failed step the scheduler forgets them too)."""
        self.encoder_cache.clear()

    def add_request_state(self, state: CachedRequestState) -> None:
        """A new request's M-RoPE positions, computed once from its prompt and images."""
        if self.model.uses_mrope and state.mrope_positions is None:
            positions, delta = self.model.get_mrope_input_positions(
                state.prompt_token_ids, state.mm_features
            )
            state.mrope_positions, state.mrope_position_delta = positions.numpy(), delta

    def run_encoders(self, so: SchedulerOutput, batch: InputBatch) -> None:
        """Drop the entries the scheduler evicted, then encode this step's new images in one
        call (each identifier once)."""
        for identifier in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        todo: dict[str, tuple[str, MultiModalFeatureSpec]] = {}
        for req_id, indices in so.scheduled_encoder_inputs.items():
            features = batch.requests[req_id].mm_features
            for index in indices:
                feature = features[index]
                if feature.identifier not in self.encoder_cache:
                    todo.setdefault(feature.identifier, (req_id, feature))
        if not todo:
            return
        try:
            outputs = self.model.embed_multimodal([f for _, f in todo.values()])
        except Exception:
            # one at a time, so that a bad image fails its own request alone
            outputs = []
            for req_id, feature in todo.values():
                with blame_request(req_id):
                    outputs.extend(self.model.embed_multimodal([feature]))
        for identifier, (_, feature), embeds in zip(todo, todo.values(), outputs, strict=True):
            if embeds.shape[0] != feature.num_embeds:
                raise RuntimeError(
                    f"The vision encoder gave {embeds.shape[0]} rows for an image with "
                    f"{feature.num_embeds} placeholder tokens."
                )
            self.encoder_cache[identifier] = embeds

    def has_mm_tokens(self, inputs: StepInputs) -> bool:
        """Whether the step computes any placeholder token."""
        return next(_scheduled_features(inputs), None) is not None

    def inputs_embeds(self, inputs: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings with every placeholder row replaced by its image's output."""
        embeds = self.model.embed_input_ids(input_ids)
        for _, row, feature, lo, hi in _scheduled_features(inputs):
            offset = feature.mm_position.offset
            source = self.encoder_cache[feature.identifier]
            embeds[row : row + hi - lo] = source[lo - offset : hi - offset].to(embeds.dtype)
        return embeds

    def bidirectional_spans(self, inputs: StepInputs) -> np.ndarray | None:
        """[k, 4] (request, first row, rows, end position) of the image tokens the step
        computes (attention/backend.py), for a model whose image tokens attend both ways."""
        spans = []
        for i, row, feature, lo, hi in _scheduled_features(inputs):
            end = feature.mm_position.end
            assert hi == end, "an image cut by a chunk (disable_chunked_mm_input)"
            spans.append((i, row, hi - lo, end))
        return np.asarray(spans, dtype=np.int64) if spans else None

    def mrope_positions(self, inputs: StepInputs) -> np.ndarray:
        """[3, num_tokens] positions, or [num_tokens] when every token has equal three (text
        tokens: then M-RoPE is plain RoPE and the 1-D kernels apply)."""
        positions = inputs.positions
        out = np.repeat(positions[None], 3, axis=0)
        qsl = inputs.attn.query_start_loc
        for i, state in enumerate(inputs.states):
            if state.mrope_positions is None:
                continue
            rows = slice(int(qsl[i]), int(qsl[i + 1]))
            p = positions[rows]
            in_prompt = p < state.num_prompt_tokens
            block = out[:, rows]
            block[:, in_prompt] = state.mrope_positions[:, p[in_prompt]]
            block[:, ~in_prompt] = p[~in_prompt] + state.mrope_position_delta
        if (out[0] == out[1]).all() and (out[0] == out[2]).all():
            return out[0].copy()
        return out


def _scheduled_features(
    inputs: StepInputs,
) -> Iterator[tuple[int, int, MultiModalFeatureSpec, int, int]]:
    """(request index, first row, feature, first position, end position) of each image
    whose placeholder tokens the step computes, for the positions [lo, hi) it computes."""
    qsl = inputs.attn.query_start_loc
    starts = inputs.positions[qsl[:-1]].tolist()
    for i, (state, row0, row_end, start) in enumerate(
        zip(inputs.states, qsl[:-1].tolist(), qsl[1:].tolist(), starts, strict=True)
    ):
        end = start + row_end - row0
        for _, feature in features_in(state.mm_features, start, end):
            position = feature.mm_position
            lo, hi = max(start, position.offset), min(end, position.end)
            yield i, row0 + lo - start, feature, lo, hi
