"""What crosses the engine/worker boundary: plain data only, cheap to pickle.

`SchedulerOutput` is a diff against what the workers already know: a request is sent whole
once (`NewRequestData`; again after a failed step made the workers forget their requests),
later only its new tokens and blocks (`CachedRequestData`). Workers
keep each request's state until its id appears in `finished_req_ids`; a preempted request
leaves the batch but keeps that state, and comes back with `resumed_from_preemption` and a
new block list. No `Request`, KV manager or other live engine object is referenced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedlm.lora.request import LoRARequest
from pagedlm.multimodal.inputs import MultiModalFeatureSpec
from pagedlm.pooling_params import PoolingParams
from pagedlm.runner_outputs import LogprobsLists
from pagedlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.structured_output import GrammarOutput


@dataclass
class NewRequestData:
    """A request the workers have not seen: everything they need to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: positions [0, n) are already in the cache
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # a small dataclass; the worker loads it
    # tokens generated so far: non-empty when the request is re-sent whole after the workers
    # forgot their requests (a failed step)
    output_token_ids: list[int] = field(default_factory=list)
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)  # its images


@dataclass
class CachedRequestData:
    """Requests the workers hold, as parallel lists (one entry per scheduled request)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Tokens appended to the request since the workers last heard of it (sampled tokens).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Blocks to append; for a resumed request, its whole new block list.
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step: which requests compute how many tokens.

    `num_computed_tokens[req_id]` is the request's count *before* this step: its new tokens are
    positions [num_computed_tokens, num_computed_tokens + num_scheduled_tokens).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    scheduled_req_ids: list[str] = field(default_factory=list)  # scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # Draft tokens to verify this step (speculative decoding): they follow the request's last
    # token, so num_scheduled_tokens = (tokens to compute) + len(drafts).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: bitmask rows of this step's grammar-constrained samples (plain data).
    grammar_output: GrammarOutput | None = None
    # Images to encode this step (req_id -> indices into its mm_features), after the workers
    # drop the encoder outputs of `free_encoder_mm_hashes` (identifiers).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    pooling_output: Any = None
    scheduled_ts: float = 0.0  # monotonic time the request was first scheduled
    new_sampling_mask: list[list[int]] | None = None  # per new token: surviving token ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
