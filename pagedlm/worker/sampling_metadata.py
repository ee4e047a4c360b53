"""SamplingMetadata for the rows sampled this step, sliced from the persistent batch's arrays.

Dense parameters (temperature, top-k/p, min-p, penalties, logprob counts) are gathered with
numpy; only the sparse logits processors (allowed ids, bad words, logit bias, min_tokens) and
seeded generators visit the requests that use them.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedlm.layers.sampler import SamplingMetadata
from pagedlm.worker.input_batch import CachedRequestState, InputBatch


def build_sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    states: list[CachedRequestState],
    device: torch.device,
    logprobs_mode: str,
) -> SamplingMetadata:
    """Metadata for `rows` of `batch` (`states[i]` is the request of `rows[i]`)."""
    vocab = batch.vocab_size
    temperature = batch.temperature[rows]
    md = SamplingMetadata(
        temperature=torch.from_numpy(temperature).to(device),
        all_greedy=bool((temperature == 0.0).all()),
    )
    top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
    if (top_k < vocab).any():
        md.top_k = torch.from_numpy(top_k).to(device)
    if (top_p < 1.0).any():
        md.top_p = torch.from_numpy(top_p).to(device)
    if (min_p > 0.0).any():
        md.min_p = torch.from_numpy(min_p).to(device)
    presence = batch.presence_penalty[rows]
    frequency = batch.frequency_penalty[rows]
    repetition = batch.repetition_penalty[rows]
    if presence.any() or frequency.any() or (repetition != 1.0).any():
        md.presence_penalties = torch.from_numpy(presence).to(device)
        md.frequency_penalties = torch.from_numpy(frequency).to(device)
        md.repetition_penalties = torch.from_numpy(repetition).to(device)
        md.prompt_token_ids = [batch.prompt_token_ids(r) for r in rows.tolist()]
    num_logprobs = batch.num_logprobs[rows]
    if len(rows) and num_logprobs.max() >= 0:
        md.max_num_logprobs = int(num_logprobs.max())
    md.logprobs_mode = logprobs_mode
    num_output = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    for i in np.flatnonzero(batch.needs_visit[rows]).tolist():
        state = states[i]
        p = state.sampling_params
        assert p is not None
        if state.generator is not None and temperature[i] > 0.0:
            md.generators[i] = state.generator
        if p.allowed_token_ids:
            md.allowed_token_ids[i] = list(p.allowed_token_ids)
        if p.bad_words_token_ids:
            md.bad_words_token_ids[i] = p.bad_words_token_ids
        if p.logit_bias:
            md.logit_bias[i] = {int(k): float(v) for k, v in p.logit_bias.items()}
        if p.logprob_token_ids:
            md.logprob_token_ids[i] = list(p.logprob_token_ids)
        if num_output[i] < p.min_tokens:
            stop_ids = set(p.all_stop_token_ids) | set(p.stop_token_ids)
            if p.eos_token_id is not None and not p.ignore_eos:
                stop_ids.add(p.eos_token_id)
            if stop_ids:
                md.min_tokens_stop_ids[i] = sorted(stop_ids)
    if md.bad_words_token_ids or md.repetition_penalties is not None:
        md.output_token_ids = [batch.output_token_ids(r) for r in rows.tolist()]
    return md
