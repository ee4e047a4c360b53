"""What one scheduling step decided, and what the engine core reports back per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedlm.core.request import Request


@dataclass
class SchedulerOutput:
    """Requests in batch order, with how many tokens each computes this step.

    `num_computed_tokens[req_id]` is the request's count *before* this step: its new tokens are
    positions [num_computed_tokens, num_computed_tokens + num_scheduled_tokens).
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class LogprobsLists:
    """Logprobs of sampled tokens: per token, ids and logprobs (sampled first, then top-k)."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ModelRunnerOutput:
    """Per request that produced something this step (sampled a token or prompt logprobs)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    pooler_output: dict[str, Any] = field(default_factory=dict)
