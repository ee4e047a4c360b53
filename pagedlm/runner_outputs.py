"""What the workers return to the engine each step: plain data, cheap to pickle.

The other half of the engine/worker contract (`core/sched_output.py` holds what the engine
sends). It lives below both sides: the sampler fills `LogprobsLists`, the model runner
`ModelRunnerOutput`, the scheduler reads them; none of them owns the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LogprobsLists:
    """Logprobs of sampled tokens: per token, ids and logprobs (sampled first, then top-k)."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def first(self, num_tokens: int) -> LogprobsLists:
        """The entries of the first `num_tokens` tokens."""
        return LogprobsLists(
            self.logprob_token_ids[:num_tokens],
            self.logprobs[:num_tokens],
            self.sampled_token_ranks[:num_tokens],
        )


@dataclass
class ModelRunnerOutput:
    """Per request that produced something this step (sampled a token or prompt logprobs).

    With speculative decoding a request may get several tokens: its accepted drafts, then one
    token of the target model. `spec_token_ids` are the drafts proposed for the next step.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    pooler_output: dict[str, Any] = field(default_factory=dict)
    sampling_mask: dict[str, list[list[int]]] = field(default_factory=dict)  # return_sampling_mask
