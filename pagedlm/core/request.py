"""Request: the engine core's state of one sequence (one child when n > 1).

Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
`0 <= num_computed_tokens <= num_tokens`; `block_hashes` covers exactly the full blocks of
`all_token_ids` (extended as tokens arrive, output tokens included).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagedlm.core.block_hash import hash_request_blocks

if TYPE_CHECKING:
    from pagedlm.lora.request import LoRARequest
    from pagedlm.multimodal.inputs import MultiModalFeatureSpec
    from pagedlm.sampling_params import SamplingParams
    from pagedlm.structured_output import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        max_tokens: int,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        block_size: int = 16,
        cache_salt: str | None = None,
        pooling_params: object | None = None,
        token_type_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
    ) -> None:
        self.request_id = request_id
        self.mm_features = mm_features or []  # images in prompt order (multimodal/inputs.py)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.token_type_ids = token_type_ids
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []  # drafts to verify next step (speculative decoding)
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling, -1 = not yet
        self.num_preemptions = 0
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # Mixed into the first block's hash (chained: into every block's): KV computed under
        # one LoRA adapter is reused only by requests of the same adapter.
        self._hash_salt: object = cache_salt
        if lora_request is not None:
            self._hash_salt = (cache_salt, lora_request.lora_int_id, lora_request.lora_name)
        self.block_hashes: list[bytes] = []
        self.update_block_hashes()
        # What the workers know of this request (the scheduler sends them diffs).
        self.sent_to_workers = False
        self.resumed_from_preemption = False
        self.num_synced_tokens = 0
        self.num_synced_blocks = 0
        # Structured outputs: the grammar matcher, set by the engine (None: unconstrained).
        self.structured_output_request: StructuredOutputRequest | None = None
        # Timestamps (monotonic) for metrics.
        self.queued_ts = time.monotonic()
        self.scheduled_ts = 0.0
        self.first_token_ts = 0.0
        self.last_token_ts = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the full blocks not hashed yet (chained on the previous block's hash)."""
        self.block_hashes.extend(
            hash_request_blocks(
                self._all_token_ids,
                self.block_size,
                self.block_hashes,
                self._hash_salt,
                self.mm_features,
            )
        )

    def __lt__(self, other: Request) -> bool:  # priority heap order
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
