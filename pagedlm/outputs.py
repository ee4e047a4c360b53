"""Request outputs (the ``vllm.outputs`` surface): generation and pooling results."""

from __future__ import annotations

import logging
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from pagedlm.logprobs import PromptLogprobs, SampleLogprobs

logger = logging.getLogger(__name__)

_warned_extra_kwargs: set[str] = set()


@dataclass
class SamplingMask:
    """Per generated token, the token ids that survived the sampling filters (ascending).

    ``token_ids[i]`` belongs to ``CompletionOutput.token_ids[i]``: the ids whose logit was still
    finite after the grammar, allowed_token_ids, bad words, min_tokens, logit_bias, min_p, top-k
    and top-p (for greedy rows: after the logits processors only).
    """

    token_ids: list[list[int]]


@dataclass
class CompletionOutput:
    """One completion (one of the ``n``) of a request.

    ``token_ids`` are generated tokens only. ``cumulative_logprob`` and ``logprobs`` are None
    unless logprobs were requested. ``finish_reason`` is None until the completion finishes;
    ``stop_reason`` is the stop string or stop token id that ended it (None for EOS).
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    routed_experts: Any | None = None  # np.ndarray [seq_len, num_layers, top_k] for MoE
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any | None = None
    sampling_mask: SamplingMask | None = None  # with LLM(return_sampling_mask=True)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        # vLLM's newer repr shows sampling_mask; shown here only when set, so the common
        # repr stays the released one
        mask = "" if self.sampling_mask is None else f"sampling_mask={self.sampling_mask}, "
        return (
            f"CompletionOutput(index={self.index}, "
            f"text={self.text!r}, "
            f"token_ids={self.token_ids}, "
            f"routed_experts={self.routed_experts}, "
            f"{mask}"
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass
class RequestStateStats:
    """Per-request timing stats; ``*_ts`` are monotonic engine-clock seconds, ``arrival_time``
    is wall-clock."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False


class RequestOutput:
    """The output of one generation request.

    ``outputs`` holds the request's completions ordered by ``index``. Unknown keyword
    arguments are accepted and ignored (with a one-time warning) for forward compatibility.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: RequestStateStats | None = None,
        lora_request: Any | None = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            message = str(kwargs)
            if message not in _warned_extra_kwargs:
                _warned_extra_kwargs.add(message)
                logger.warning("RequestOutput: Ignoring extra arguments: %s", message)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.kv_transfer_params = kv_transfer_params

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later streamed output of the same request into this one.

        With ``aggregate`` (DELTA outputs) a completion with the same index gets the new text,
        tokens and logprobs appended; otherwise it is replaced. New indices are appended.
        """
        self.finished |= next_output.finished
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index != nxt.index:
                    continue
                if not aggregate:
                    self.outputs[i] = nxt
                    break
                cur.text += nxt.text
                if not isinstance(cur.token_ids, MutableSequence):
                    cur.token_ids = list(cur.token_ids)
                cur.token_ids.extend(nxt.token_ids)  # type: ignore[attr-defined]
                if nxt.logprobs:
                    if cur.logprobs is None:
                        cur.logprobs = nxt.logprobs[:]
                    else:
                        cur.logprobs.extend(nxt.logprobs)  # type: ignore[arg-type]
                cur.cumulative_logprob = nxt.cumulative_logprob
                cur.finish_reason = nxt.finish_reason
                cur.stop_reason = nxt.stop_reason
                break
            else:
                self.outputs.append(nxt)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, "
            f"prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"encoder_prompt={self.encoder_prompt!r}, "
            f"encoder_prompt_token_ids={self.encoder_prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, "
            f"finished={self.finished}, "
            f"metrics={self.metrics}, "
            f"lora_request={self.lora_request}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


STREAM_FINISHED = RequestOutput(
    request_id="",
    prompt=None,
    prompt_token_ids=None,
    prompt_logprobs=None,
    outputs=[],
    finished=True,
)
"""Sentinel output marking the end of a stream."""


@dataclass(eq=False)
class PoolingOutput:
    """Raw pooled data (e.g. hidden states) of one request; None when the request failed in
    a model step (the engine logged why)."""

    data: torch.Tensor | None

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, self.__class__)
            and self.data.shape == other.data.shape
            and bool((self.data == other.data).all())
        )

    __hash__ = None  # type: ignore[assignment]


_O = TypeVar("_O")


class PoolingRequestOutput(Generic[_O]):
    """The output of one pooling request. Note the argument order."""

    def __init__(
        self,
        request_id: str,
        outputs: _O,
        prompt_token_ids: list[int],
        num_cached_tokens: int,
        finished: bool,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished
        self.outputs = outputs

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, "
            f"outputs={self.outputs!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"num_cached_tokens={self.num_cached_tokens}, "
            f"finished={self.finished})"
        )


def _pooled_data(pooling_output: PoolingOutput | Any) -> torch.Tensor:
    data = pooling_output.data if isinstance(pooling_output, PoolingOutput) else pooling_output
    return data if isinstance(data, torch.Tensor) else torch.as_tensor(data)


@dataclass
class EmbeddingOutput:
    """An embedding vector; ``hidden_size == len(embedding)``."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        data = _pooled_data(pooling_output)
        if data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=request_output.request_id,
            outputs=EmbeddingOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            num_cached_tokens=request_output.num_cached_tokens,
            finished=request_output.finished,
        )


@dataclass
class ClassificationOutput:
    """Class probabilities; ``num_classes == len(probs)``."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        data = _pooled_data(pooling_output)
        if data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    def __repr__(self) -> str:
        return f"ClassificationOutput(num_classes={self.num_classes})"


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(
            request_id=request_output.request_id,
            outputs=ClassificationOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            num_cached_tokens=request_output.num_cached_tokens,
            finished=request_output.finished,
        )


@dataclass
class ScoringOutput:
    """A scalar similarity score; the pooled data is squeezed to 0-D."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ScoringOutput:
        data = _pooled_data(pooling_output).squeeze()
        if data.ndim != 0:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(data.item())

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ScoringRequestOutput:
        return ScoringRequestOutput(
            request_id=request_output.request_id,
            outputs=ScoringOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            num_cached_tokens=request_output.num_cached_tokens,
            finished=request_output.finished,
        )
