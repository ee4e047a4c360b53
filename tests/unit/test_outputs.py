"""Output classes: RequestOutput, CompletionOutput and the pooling outputs."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedlm.logprobs import FlatLogprobs, Logprob
from pagedlm.outputs import (
    STREAM_FINISHED,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    RequestStateStats,
    ScoringOutput,
    ScoringRequestOutput,
)


def _completion(index: int = 0, text: str = "hi", **kw: object) -> CompletionOutput:
    return CompletionOutput(
        index=index, text=text, token_ids=[1, 2], cumulative_logprob=None, logprobs=None, **kw
    )  # type: ignore[arg-type]


def test_completion_output_defaults_and_finished() -> None:
    out = _completion()
    assert out.routed_experts is None and out.lora_request is None
    assert out.finish_reason is None and out.stop_reason is None
    assert not out.finished()
    out.finish_reason = "stop"
    assert out.finished()


def test_completion_output_repr() -> None:
    text = repr(_completion(finish_reason="length"))
    assert text == (
        "CompletionOutput(index=0, text='hi', token_ids=[1, 2], routed_experts=None, "
        "cumulative_logprob=None, logprobs=None, finish_reason=length, stop_reason=None)"
    )


def test_request_output_ignores_unknown_kwargs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedlm.outputs"):
        for _ in range(2):
            out = RequestOutput(
                request_id="0",
                prompt="p",
                prompt_token_ids=[1],
                prompt_logprobs=None,
                outputs=[_completion()],
                finished=True,
                some_future_field=123,
            )
    assert out.request_id == "0" and out.finished
    assert not hasattr(out, "some_future_field")
    assert caplog.text.count("Ignoring extra arguments") == 1
    assert out.metrics is None and out.num_cached_tokens is None


def test_request_output_attributes_and_repr() -> None:
    stats = RequestStateStats(num_generation_tokens=3)
    out = RequestOutput(
        "7", None, [4, 5], [None, {5: Logprob(-0.5)}], [_completion()], False, metrics=stats,
        num_cached_tokens=0, kv_transfer_params={"a": 1},
    )  # fmt: skip
    assert out.prompt is None and out.metrics is stats and out.kv_transfer_params == {"a": 1}
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    text = repr(out)
    assert text.startswith("RequestOutput(request_id=7, prompt=None, prompt_token_ids=[4, 5], ")
    assert "encoder_prompt=None, encoder_prompt_token_ids=None, prompt_logprobs=" in text
    assert text.endswith("lora_request=None, num_cached_tokens=0)")


def test_request_state_stats_defaults() -> None:
    stats = RequestStateStats()
    assert stats.num_generation_tokens == 0 and stats.arrival_time == 0.0
    assert stats.first_token_latency == 0.0 and stats.is_corrupted is False


def test_request_output_add_aggregate() -> None:
    first = RequestOutput("0", "p", [1], None, [_completion(0, "a")], False)
    first.outputs[0].token_ids = (1,)  # an immutable sequence must still be extendable
    nxt = _completion(0, "b", finish_reason="stop", stop_reason=7)
    nxt.token_ids = [3]
    first.add(RequestOutput("0", "p", [1], None, [nxt, _completion(1, "z")], True), True)
    assert first.finished
    assert first.outputs[0].text == "ab" and list(first.outputs[0].token_ids) == [1, 3]
    assert first.outputs[0].finish_reason == "stop" and first.outputs[0].stop_reason == 7
    assert [o.index for o in first.outputs] == [0, 1]


def test_request_output_add_aggregate_logprobs() -> None:
    a = _completion(0, "a")
    a.logprobs = FlatLogprobs()
    a.logprobs.append({1: Logprob(-0.1)})
    b = _completion(0, "b")
    b.logprobs = [{2: Logprob(-0.2)}]
    b.cumulative_logprob = -0.3
    out = RequestOutput("0", None, [1], None, [a], False)
    out.add(RequestOutput("0", None, [1], None, [b], False), aggregate=True)
    assert len(out.outputs[0].logprobs) == 2  # type: ignore[arg-type]
    assert out.outputs[0].cumulative_logprob == -0.3


def test_request_output_add_replace() -> None:
    first = RequestOutput("0", "p", [1], None, [_completion(0, "a")], False)
    replacement = _completion(0, "abc")
    first.add(RequestOutput("0", "p", [1], None, [replacement], False), aggregate=False)
    assert first.outputs[0] is replacement and not first.finished


def test_stream_finished_sentinel() -> None:
    assert STREAM_FINISHED.finished and STREAM_FINISHED.outputs == []


def test_pooling_output_eq() -> None:
    a = PoolingOutput(torch.tensor([1.0, 2.0]))
    assert a == PoolingOutput(torch.tensor([1.0, 2.0]))
    assert a != PoolingOutput(torch.tensor([1.0, 3.0]))
    assert a != PoolingOutput(torch.tensor([1.0, 2.0, 3.0]))
    assert a != "x"


def _pooled(data: torch.Tensor) -> PoolingRequestOutput[PoolingOutput]:
    return PoolingRequestOutput("3", PoolingOutput(data), [1, 2], 0, True)


def test_pooling_request_output_repr() -> None:
    text = repr(_pooled(torch.zeros(2)))
    assert text.startswith("PoolingRequestOutput(request_id='3', outputs=PoolingOutput(")
    assert text.endswith("prompt_token_ids=[1, 2], num_cached_tokens=0, finished=True)")


def test_embedding_from_base() -> None:
    out = EmbeddingRequestOutput.from_base(_pooled(torch.tensor([0.5, 1.5, 2.5])))
    assert isinstance(out, EmbeddingRequestOutput)
    assert isinstance(out.outputs, EmbeddingOutput)
    assert out.outputs.embedding == [0.5, 1.5, 2.5] and out.outputs.hidden_size == 3
    assert (out.request_id, out.prompt_token_ids, out.num_cached_tokens, out.finished) == (
        "3", [1, 2], 0, True,
    )  # fmt: skip
    assert repr(out.outputs) == "EmbeddingOutput(hidden_size=3)"
    with pytest.raises(ValueError, match="1-D"):
        EmbeddingOutput.from_base(PoolingOutput(torch.zeros(2, 2)))


def test_classification_from_base() -> None:
    out = ClassificationRequestOutput.from_base(_pooled(torch.tensor([0.25, 0.75])))
    assert isinstance(out.outputs, ClassificationOutput)
    assert out.outputs.probs == [0.25, 0.75] and out.outputs.num_classes == 2
    with pytest.raises(ValueError):
        ClassificationOutput.from_base(PoolingOutput(torch.tensor(1.0)))


def test_scoring_from_base() -> None:
    out = ScoringRequestOutput.from_base(_pooled(torch.tensor([[0.5]])))
    assert isinstance(out.outputs, ScoringOutput) and out.outputs.score == 0.5
    assert repr(out.outputs) == "ScoringOutput(score=0.5)"
    with pytest.raises(ValueError, match="scalar"):
        ScoringOutput.from_base(PoolingOutput(torch.tensor([0.1, 0.2])))
