"""Logprob containers (the ``vllm.logprobs`` surface).

A request's logprobs are a sequence with one entry per position: either a plain
``list[dict[int, Logprob] | None]`` or a ``FlatLogprobs``, which stores the same data in a few
flat parallel lists (far fewer Python objects for long generations).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, overload


@dataclass
class Logprob:
    """One candidate token at one position.

    ``rank`` is the 1-based vocabulary rank; ``decoded_token`` is None when detokenize=False.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition: TypeAlias = dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence[LogprobsOnePosition | None]):
    """Logprobs of all positions of a request, flattened into parallel lists.

    Position ``i`` owns the entries ``start_indices[i]:end_indices[i]`` of ``token_ids``,
    ``logprobs``, ``ranks`` and ``decoded_tokens``. It is append-only: setting, deleting and
    inserting positions raise ``TypeError``. A position appended as ``None`` (the first prompt
    position) is stored empty and reads back as ``{}``.
    """

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, logprobs_one_position: LogprobsOnePosition | None) -> None:
        """Add the next position."""
        self.start_indices.append(len(self.logprobs))
        if logprobs_one_position:
            for token_id, lp in logprobs_one_position.items():
                self.token_ids.append(token_id)
                self.logprobs.append(lp.logprob)
                self.ranks.append(lp.rank)
                self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_fast(
        self,
        token_ids: Iterable[int],
        logprobs: Iterable[float],
        ranks: Iterable[int | None],
        decoded_tokens: Iterable[str | None],
    ) -> None:
        """Add the next position from parallel iterables, without building a dict.

        Entries are zipped (the shortest iterable wins) and stored as given, duplicates
        included; reading the position back as a dict keeps the last duplicate's values.
        """
        self.start_indices.append(len(self.logprobs))
        for token_id, lp, rank, text in zip(
            token_ids, logprobs, ranks, decoded_tokens, strict=True
        ):
            self.token_ids.append(token_id)
            self.logprobs.append(lp)
            self.ranks.append(rank)
            self.decoded_tokens.append(text)
        self.end_indices.append(len(self.logprobs))

    def extend(self, logprobs_multi_positions: Iterable[LogprobsOnePosition | None]) -> None:
        """Add several positions (from a list of dicts or another FlatLogprobs)."""
        if isinstance(logprobs_multi_positions, FlatLogprobs):
            other = logprobs_multi_positions
            offset = len(self.logprobs)
            self.start_indices.extend(i + offset for i in other.start_indices)
            self.end_indices.extend(i + offset for i in other.end_indices)
            self.token_ids.extend(other.token_ids)
            self.logprobs.extend(other.logprobs)
            self.ranks.extend(other.ranks)
            self.decoded_tokens.extend(other.decoded_tokens)
            return
        for logprobs_one_position in logprobs_multi_positions:
            self.append(logprobs_one_position)

    def __len__(self) -> int:
        """Number of positions."""
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> LogprobsOnePosition | FlatLogprobs:
        """An int gives that position's dict; a slice gives a new FlatLogprobs."""
        if isinstance(index, slice):
            starts = self.start_indices[index]
            ends = self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            if index.step not in (None, 1):
                out = FlatLogprobs()
                for start, end in zip(starts, ends, strict=True):
                    out._append_range(self, start, end)
                return out
            lo, hi = starts[0], ends[-1]
            return FlatLogprobs(
                start_indices=[i - lo for i in starts],
                end_indices=[i - lo for i in ends],
                token_ids=self.token_ids[lo:hi],
                logprobs=self.logprobs[lo:hi],
                ranks=self.ranks[lo:hi],
                decoded_tokens=self.decoded_tokens[lo:hi],
            )
        if isinstance(index, int):
            return {
                self.token_ids[i]: Logprob(
                    logprob=self.logprobs[i],
                    rank=self.ranks[i],
                    decoded_token=self.decoded_tokens[i],
                )
                for i in range(self.start_indices[index], self.end_indices[index])
            }
        raise TypeError(f"Invalid index type: {type(index)}")

    def _append_range(self, src: FlatLogprobs, start: int, end: int) -> None:
        self.start_indices.append(len(self.logprobs))
        self.token_ids.extend(src.token_ids[start:end])
        self.logprobs.extend(src.logprobs[start:end])
        self.ranks.extend(src.ranks[start:end])
        self.decoded_tokens.extend(src.decoded_tokens[start:end])
        self.end_indices.append(len(self.logprobs))

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: LogprobsOnePosition | None) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self.start_indices)):
            yield self[i]


PromptLogprobs: TypeAlias = FlatLogprobs | list[LogprobsOnePosition | None]
"""Per prompt position; the first position has no logprobs (None, or ``{}`` when flat)."""
SampleLogprobs: TypeAlias = FlatLogprobs | list[LogprobsOnePosition]
"""Per generated token: the sampled token plus the top-k candidates."""


def create_prompt_logprobs(flat_logprobs: bool) -> PromptLogprobs:
    """An empty prompt-logprobs container holding the first position's None."""
    logprobs: PromptLogprobs = FlatLogprobs() if flat_logprobs else []
    logprobs.append(None)
    return logprobs


def create_sample_logprobs(flat_logprobs: bool) -> SampleLogprobs:
    """An empty sample-logprobs container."""
    return FlatLogprobs() if flat_logprobs else []


def append_logprobs_for_next_position(
    request_logprobs: PromptLogprobs | SampleLogprobs,
    token_ids: list[int],
    logprobs: list[float],
    decoded_tokens: Iterable[str | None],
    rank: int,
    num_logprobs: int,
) -> None:
    """Append one position: entry 0 is the sampled/actual token with rank ``rank``; the rest
    are the top-``num_logprobs`` candidates with ranks 1..k (-1 means all given candidates).

    If the sampled token is also among the top-k, its dict entry is overwritten by the top-k
    one (same logprob, rank from the top-k list), as in vLLM.
    """
    if num_logprobs == -1:
        num_logprobs = len(logprobs)
    ranks = itertools.chain((rank,), range(1, num_logprobs + 1))
    if isinstance(request_logprobs, FlatLogprobs):
        request_logprobs.append_fast(token_ids, logprobs, ranks, decoded_tokens)
        return
    request_logprobs.append(
        {
            token_id: Logprob(logprob=lp, rank=r, decoded_token=text)
            for token_id, lp, r, text in zip(
                token_ids, logprobs, ranks, decoded_tokens, strict=True
            )
        }
    )


def last_sampled_token_ids(
    request_logprobs: PromptLogprobs | SampleLogprobs, count: int
) -> list[int]:
    """The sampled (or actual prompt) token of each of the last ``count`` positions, oldest
    first, skipping empty ones: entry 0 of a position is always that token."""
    start = max(0, len(request_logprobs) - count)
    if isinstance(request_logprobs, FlatLogprobs):
        first, last = request_logprobs.start_indices, request_logprobs.end_indices
        return [
            request_logprobs.token_ids[first[i]]
            for i in range(start, len(request_logprobs))
            if first[i] < last[i]
        ]
    positions = (request_logprobs[i] for i in range(start, len(request_logprobs)))
    return [next(iter(position)) for position in positions if position]
