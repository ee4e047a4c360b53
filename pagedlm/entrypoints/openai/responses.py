"""Finished RequestOutputs -> OpenAI response bodies: the envelope with usage, and logprobs
in the chat and the legacy completion shapes (-inf written as MIN_LOGPROB)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedlm.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from pagedlm.entrypoints.openai.protocol import ServingContext

MIN_LOGPROB = -9999.0  # written instead of -inf (and NaN) logprobs, as OpenAI and vLLM do


def response_body(
    prefix: str,
    obj: str,
    output: RequestOutput,
    ctx: ServingContext,
    choice: Callable[[CompletionOutput], dict[str, Any]],
) -> dict[str, Any]:
    prompt_tokens = len(output.prompt_token_ids or ())
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {
        "id": f"{prefix}-{output.request_id}",
        "object": obj,
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": [
            {**choice(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in output.outputs
        ],
        "usage": {**usage, "total_tokens": prompt_tokens + completion_tokens},
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _token_str(token_id: int, lp: Any, tokenizer: Any, as_ids: bool) -> str:
    if lp is not None and lp.decoded_token is not None and not as_ids:
        return lp.decoded_token
    if as_ids or tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


# One generated token: (its text, its logprob or None, [(text, logprob)] of the top k tokens).
_Step = tuple[str, "float | None", list[tuple[str, float]]]


def logprob_steps(c: CompletionOutput, tokenizer: Any, k: int, as_ids: bool) -> list[_Step]:
    steps: list[_Step] = []
    for token_id, position in zip(c.token_ids, c.logprobs or (), strict=True):
        position = position or {}
        sampled = position.get(token_id)
        ranked = sorted(  # by vocabulary rank: the sampled token may or may not be in the top k
            position.items(),
            key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf, -kv[1].logprob),
        )
        top = [(_token_str(t, lp, tokenizer, as_ids), _finite(lp.logprob)) for t, lp in ranked[:k]]
        logprob = None if sampled is None else _finite(sampled.logprob)
        steps.append((_token_str(token_id, sampled, tokenizer, as_ids), logprob, top))
    return steps


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(steps: list[_Step]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": token,
                "logprob": MIN_LOGPROB if logprob is None else logprob,
                "bytes": _bytes(token),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in top],
            }
            for token, logprob, top in steps
        ]
    }


def completion_logprobs(steps: list[_Step]) -> dict[str, Any]:
    """OpenAI's legacy shape; each top_logprobs entry has the top k plus the sampled token."""
    tokens = [token for token, _, _ in steps]
    sampled = [{} if v is None else {t: v} for t, v, _ in steps]
    return {
        "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1],
        "token_logprobs": [logprob for _, logprob, _ in steps],
        "tokens": tokens,
        "top_logprobs": [{**dict(top), **s} for (_, _, top), s in zip(steps, sampled, strict=True)],
    }
