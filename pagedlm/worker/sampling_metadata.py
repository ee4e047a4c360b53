"""Build SamplingMetadata for the requests sampled this step (a loop over requests, not tokens)."""

from __future__ import annotations

import torch

from pagedlm.core.request import Request
from pagedlm.layers.sampler import SamplingMetadata

_SAMPLING_EPS = 1e-5


def build_sampling_metadata(
    requests: list[Request], vocab_size: int, device: torch.device, logprobs_mode: str
) -> SamplingMetadata:
    temperature, top_k, top_p, min_p = [], [], [], []
    presence, frequency, repetition = [], [], []
    generators: dict[int, torch.Generator] = {}
    md = SamplingMetadata(temperature=torch.empty(0), all_greedy=True)
    max_logprobs: int | None = None
    for row, request in enumerate(requests):
        p = request.sampling_params
        assert p is not None
        greedy = p.temperature < _SAMPLING_EPS
        md.all_greedy &= greedy
        temperature.append(0.0 if greedy else p.temperature)
        top_k.append(p.top_k if p.top_k > 0 else vocab_size)
        top_p.append(p.top_p)
        min_p.append(p.min_p)
        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        repetition.append(p.repetition_penalty)
        if request.generator is not None and not greedy:
            generators[row] = request.generator
        if p.logprobs is not None:
            k = vocab_size if p.logprobs == -1 else p.logprobs
            max_logprobs = max(max_logprobs or 0, k)
        if p.allowed_token_ids:
            md.allowed_token_ids[row] = list(p.allowed_token_ids)
        if p.bad_words_token_ids:
            md.bad_words_token_ids[row] = p.bad_words_token_ids
        if p.logit_bias:
            md.logit_bias[row] = {int(k): float(v) for k, v in p.logit_bias.items()}
        if request.num_output_tokens < p.min_tokens:
            stop_ids = sorted(p.all_stop_token_ids | set(p.stop_token_ids))
            if request.eos_token_id is not None and not p.ignore_eos:
                stop_ids = sorted(set(stop_ids) | {request.eos_token_id})
            if stop_ids:
                md.min_tokens_stop_ids[row] = stop_ids
    md.temperature = torch.tensor(temperature, dtype=torch.float32, device=device)
    if any(k < vocab_size for k in top_k):
        md.top_k = torch.tensor(top_k, dtype=torch.long, device=device)
    if any(p < 1.0 for p in top_p):
        md.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)
    if any(p > 0.0 for p in min_p):
        md.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)
    if any(presence) or any(frequency) or any(r != 1.0 for r in repetition):
        md.presence_penalties = torch.tensor(presence, dtype=torch.float32, device=device)
        md.frequency_penalties = torch.tensor(frequency, dtype=torch.float32, device=device)
        md.repetition_penalties = torch.tensor(repetition, dtype=torch.float32, device=device)
        md.prompt_token_ids = [r.prompt_token_ids for r in requests]
    if md.bad_words_token_ids or md.repetition_penalties is not None:
        md.output_token_ids = [r.output_token_ids for r in requests]
    md.generators = generators
    md.max_num_logprobs = max_logprobs
    md.logprobs_mode = logprobs_mode
    return md
