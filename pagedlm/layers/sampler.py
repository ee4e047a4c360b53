"""The sampler, in vLLM v1's order of operations, all math in fp32:

0. structured outputs: grammar bitmask rows set disallowed logits to -inf (every path);
1. raw logprobs (before any other processing) when logprobs are requested;
2. allowed_token_ids mask, bad words, min_tokens (stop ids masked), logit_bias;
3. penalties: repetition (prompt + output), frequency and presence (output);
4. greedy rows take the argmax; random rows: temperature, min_p, top-k, top-p, then an
   exponential race (argmax of p / Exp(1) noise), drawn from a per-request generator for seeded
   requests so their tokens do not depend on the rest of the batch, and for the others in one
   C pass over the logits (`gumbel_argmax_rows`; straight from the model-dtype logits when
   temperature is all that shapes the batch: `temperature_only_sample`).

`logprobs_mode` "processed_logits" / "processed_logprobs" report the logits the token was
drawn from (after steps 2-4; -inf where masked), or their log_softmax, as vLLM does: when every
row is greedy that is after the penalties; otherwise greedy rows of the batch count with
temperature 1 and their own min_p / top-k / top-p. Prompt logprobs stay raw in every mode (as
in vLLM's runner).
With return_sampling_mask, each row also reports its support: the ids still finite after step 4.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from pagedlm.kernels.cpu import argmax_rows, gumbel_argmax_rows, kernels_for
from pagedlm.runner_outputs import LogprobsLists
from pagedlm.structured_output.bitmask import apply_grammar_bitmask


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for the B rows sampled this step."""

    temperature: torch.Tensor  # [B] fp32; greedy rows are 0.0 (input_processor normalizes)
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None = None  # [B] fp32, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [B] fp32, 0.0 where disabled
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # top-k logprobs to return (-1 = whole vocab)
    # Rows returning the logprobs of these ids instead of the top-k (logprob_token_ids).
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Penalties (None when every row has neutral values).
    presence_penalties: torch.Tensor | None = None  # [B]
    frequency_penalties: torch.Tensor | None = None  # [B]
    repetition_penalties: torch.Tensor | None = None  # [B]
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Logits processors, sparse by row.
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    min_tokens_stop_ids: dict[int, list[int]] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    logprobs_mode: str = "raw_logprobs"
    # Structured outputs: logits rows constrained by a grammar and their int32 bitmask rows.
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None  # [len(grammar_rows), ceil(vocab / 32)]
    return_sampling_mask: bool = False  # report each row's surviving token ids

    @property
    def has_logits_processors(self) -> bool:
        """True when allowed ids, bad words, min_tokens or logit_bias apply to some row."""
        return bool(
            self.allowed_token_ids
            or self.bad_words_token_ids
            or self.min_tokens_stop_ids
            or self.logit_bias
        )

    @property
    def modifies_logits(self) -> bool:
        """True when a logits processor or penalty applies to some row."""
        return self.has_logits_processors or self.repetition_penalties is not None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsLists | None
    # Per row, the token ids whose processed logit is finite (the support sampled from).
    sampling_mask: list[list[int]] | None = None


def gather_logprobs(
    logprobs: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor,
    chosen_ids: dict[int, list[int]] | None = None,
) -> LogprobsLists:
    """Per row `token_ids[row]` (first, with its rank) then the top-`num_logprobs` entries,
    or, for a row in `chosen_ids`, the entries of exactly those ids in their order (vLLM's
    `logprob_token_ids`)."""
    token_logprobs = logprobs.gather(-1, token_ids.unsqueeze(-1))
    ranks = (logprobs > token_logprobs).sum(-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1)
        values = torch.cat([token_logprobs, top_logprobs], dim=-1)
    else:
        ids, values = token_ids.unsqueeze(-1), token_logprobs
    lists = LogprobsLists(ids.tolist(), values.tolist(), ranks.tolist())
    for row, chosen in (chosen_ids or {}).items():
        row_ids = [lists.logprob_token_ids[row][0], *chosen]
        lists.logprob_token_ids[row] = row_ids
        lists.logprobs[row] = logprobs[row, row_ids].tolist()
    return lists


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), through the C kernel on the CPU (torch's bf16 argmax is ~6x slower)."""
    lib = kernels_for(logits)
    if lib is not None:
        return argmax_rows(lib, logits)
    return logits.argmax(-1)


def race_kernels_for(logits: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library where its random-row sampler is vectorized (see `exponential_race`)."""
    lib = kernels_for(logits)
    return lib if lib is not None and lib.gumbel_argmax_vectorized() else None


def step_seed() -> int:
    """The C sampler's seed for one step, drawn from torch's generator (`torch.manual_seed`
    and `LLM(seed=...)` fix it)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.long))


def temperature_only_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
    """Every row random, unseeded and shaped by its temperature alone (vLLM's default
    `SamplingParams()`): one C pass over the model-dtype logits, without their fp32 copy or
    the divide. None where that does not hold: `Sampler.sample` then draws them."""
    if md.generators or md.top_k is not None or md.top_p is not None or md.min_p is not None:
        return None
    lib = race_kernels_for(logits)
    if lib is None or bool((md.temperature == 0.0).any()):
        return None
    return gumbel_argmax_rows(lib, logits, step_seed(), 1.0 / md.temperature)


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.grammar_bitmask is not None:
            # before everything (raw logprobs included, as vLLM): disallowed tokens are -inf
            logits = apply_grammar_bitmask(logits, md.grammar_rows, md.grammar_bitmask)
        fast = not (md.max_num_logprobs is not None or md.modifies_logits)
        if fast and not md.return_sampling_mask:
            if md.all_greedy:
                # casting to fp32 keeps order and ties, so the argmax of model-dtype logits
                # is exact
                return SamplerOutput(greedy_sample(logits), None)
            sampled = temperature_only_sample(logits, md)
            if sampled is not None:
                return SamplerOutput(sampled, None)
        logits = logits.float()
        sampled, processed = self.sample(self.penalized_logits(logits, md), md)
        lists = None
        if md.max_num_logprobs is not None:
            reported = self.reported_logprobs(logits, md, processed)
            lists = gather_logprobs(reported, md.max_num_logprobs, sampled, md.logprob_token_ids)
        mask = sampling_support(processed) if md.return_sampling_mask else None
        return SamplerOutput(sampled, lists, mask)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if not md.has_logits_processors:
            return logits
        logits = logits.clone()
        neg_inf = float("-inf")
        for row, allowed in md.allowed_token_ids.items():
            keep = logits[row, allowed].clone()
            logits[row] = neg_inf
            logits[row, allowed] = keep
        for row, bad_words in md.bad_words_token_ids.items():
            history = md.output_token_ids[row]
            for word in bad_words:
                prefix = word[:-1]
                if not prefix or history[len(history) - len(prefix) :] == prefix:
                    logits[row, word[-1]] = neg_inf
        for row, stop_ids in md.min_tokens_stop_ids.items():
            logits[row, stop_ids] = neg_inf
        for row, bias in md.logit_bias.items():
            ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, values)
        return logits

    @staticmethod
    def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.repetition_penalties is None:
            return logits
        num_rows, vocab = logits.shape
        device = logits.device
        output_counts = torch.zeros(num_rows, vocab, device=device)
        seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        for row in range(num_rows):
            out_ids = md.output_token_ids[row]
            if out_ids:
                ids = torch.tensor(out_ids, dtype=torch.long, device=device)
                output_counts[row].index_add_(0, ids, torch.ones(len(out_ids), device=device))
            if md.prompt_token_ids[row]:
                seen[row, md.prompt_token_ids[row]] = True
        seen |= output_counts > 0
        rep = md.repetition_penalties.unsqueeze(1).expand_as(logits)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        logits = logits - md.frequency_penalties.unsqueeze(1) * output_counts
        logits = logits - md.presence_penalties.unsqueeze(1) * (output_counts > 0)
        return logits

    def sample(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled ids, processed logits): the temperature-scaled logits after min_p, top-k
        and top-p (-inf where filtered); greedy rows are their logits."""
        if md.all_greedy:
            return greedy_sample(logits), logits
        is_greedy = md.temperature == 0.0
        processed = self.filtered_logits(logits, md)
        random = self.exponential_race(processed, md.generators)
        if not bool(is_greedy.any()):
            return random, processed
        return torch.where(is_greedy, greedy_sample(logits), random), processed

    @staticmethod
    def filtered_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The logits random rows draw from: temperature, min_p, top-k, top-p (-inf where
        filtered; greedy rows: temperature 1)."""
        is_greedy = md.temperature == 0.0
        temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
        if bool((temperature != 1.0).any()):  # x / 1 is x: skip the pass (vLLM's default)
            logits = logits / temperature.unsqueeze(1)
        if md.min_p is not None:
            probs = logits.softmax(-1)
            threshold = probs.amax(-1, keepdim=True) * md.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return apply_top_k_top_p(logits, md.top_k, md.top_p)

    @classmethod
    def filtered_probs(cls, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from."""
        return cls.filtered_logits(logits, md).softmax(-1)

    def penalized_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """[rows, vocab] fp32 after the logits processors and penalties (what `sample` takes)."""
        return self.apply_penalties(self.apply_logits_processors(logits.float(), md), md)

    def processed_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """[rows, vocab] fp32: the logits each row's token is drawn from, as `logprobs_mode`
        processed_* reports them (see `sample`)."""
        logits = self.penalized_logits(logits, md)
        return logits if md.all_greedy else self.filtered_logits(logits, md)

    def reported_logprobs(
        self, logits: torch.Tensor, md: SamplingMetadata, processed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[rows, vocab] fp32: the values `logprobs_mode` reports, from the step's logits (after
        the grammar mask) or, for processed_*, from `processed` (computed when not given)."""
        mode = md.logprobs_mode
        if mode.startswith("processed"):
            values = self.processed_logits(logits, md) if processed is None else processed
        else:
            values = logits.float()
        return values if mode.endswith("_logits") else values.log_softmax(-1)

    def target_probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """[rows, vocab] fp32: what `__call__` would sample each random row from."""
        return self.filtered_probs(self.penalized_logits(logits, md), md)

    @staticmethod
    def exponential_race(
        processed: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """Per row a draw from softmax(processed): argmax(p / q), q ~ Exp(1), no CDF search.
        Seeded rows take q from `exponential_` on their generator, vLLM's stream for a given
        seed. The others race in one pass over the logits in C where it is vectorized
        (`gumbel_argmax_rows`, AVX-512; its noise hashed from a seed drawn from torch's
        generator, so `torch.manual_seed` fixes it), else against q = -log(U): torch's
        `exponential_` is a scalar loop of ~16 ns a value, 0.6 s a step at 256 rows of a 152k
        vocabulary."""
        rows = processed.shape[0]
        lib = race_kernels_for(processed)
        if len(generators) == rows:
            out = torch.zeros(rows, dtype=torch.long, device=processed.device)
        elif lib is not None:
            out = gumbel_argmax_rows(lib, processed, step_seed())
        else:  # a U of 0 makes q infinite: that token only sits out the draw
            q = torch.empty_like(processed).uniform_().log_().neg_()
            out = processed.softmax(-1).div(q).argmax(-1)
        for row, generator in generators.items():
            q = torch.empty_like(processed[row]).exponential_(generator=generator)
            out[row] = processed[row].softmax(-1).div(q).argmax()
        return out


def sampling_support(processed: torch.Tensor) -> list[list[int]]:
    """Per row, the ascending token ids whose processed logit is finite."""
    finite = torch.isfinite(processed)
    _, cols = finite.nonzero(as_tuple=True)  # row-major: each row's ids are contiguous
    ids = cols.tolist()
    out, start = [], 0
    for count in finite.sum(-1).tolist():
        out.append(ids[start : start + count])
        start += count
    return out


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the top_k logits of each row, then the smallest set whose probability >= top_p."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        index = (top_k.clamp(1, vocab) - 1).unsqueeze(1)
        kth = sorted_logits.gather(-1, index)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        cum_before = probs.cumsum(-1) - probs  # mass strictly before each token
        # rows with top_p == 1 keep everything (fp32 cumsums can reach 1 before the tail)
        remove = (cum_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
