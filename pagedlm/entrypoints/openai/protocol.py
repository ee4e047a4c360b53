"""OpenAI request bodies -> engine requests (the response bodies are built in `responses.py`).

`URL_HANDLERS` maps each url to a `prepare_*` function: it validates one body and returns a
PreparedRequest (prompt, params, and how to turn the finished RequestOutput into the response
body) or raises RequestError, whose message goes into the line's error record. Unknown body fields
are ignored (`model` is informational); known ones we cannot honour (stream, echo, suffix,
the removed guided_* fields) are errors. `response_format` and `structured_outputs` become
structured outputs (see `structured.py`). A pooling handler replaces `prepare_embedding` later.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedlm.entrypoints.openai.responses import (
    chat_logprobs,
    completion_logprobs,
    logprob_steps,
    response_body,
)
from pagedlm.entrypoints.openai.structured import structured_outputs_from_body
from pagedlm.inputs import TokensPrompt
from pagedlm.outputs import CompletionOutput, RequestOutput
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import RequestOutputKind, SamplingParams


class RequestError(Exception):
    """Something wrong with one request line; its message goes into the error record."""


class ServingContext:
    """What the handlers need from the engine, looked up once."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
        self.max_model_len: int = engine.model_config.max_model_len
        self.default_sampling: dict[str, Any] = engine.model_config.get_diff_sampling_param()
        self.supported_tasks = tuple(engine.get_supported_tasks())


@dataclass
class PreparedRequest:
    prompt: TokensPrompt
    params: Any  # SamplingParams (PoolingParams for an embeddings handler)
    make_body: Callable[[RequestOutput], dict[str, Any]]


# ------------------------------------------------------------------ body fields
def _describe(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return _is_number(v) and (isinstance(v, int) or v.is_integer())


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "number": (_is_number, "a number"),
    "int": (_is_int, "an integer"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "ints": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
    "strs": (lambda v: isinstance(v, list) and all(type(x) is str for x in v), "a list of strings"),
}


def _field(body: dict[str, Any], name: str, kind: str) -> Any:
    """body[name] checked against `kind`; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    check, description = _KINDS[kind]
    if not check(value):
        raise RequestError(f"'{name}' must be {description}, got {_describe(value)}.")
    return int(value) if kind == "int" else [int(v) for v in value] if kind == "ints" else value


_SAMPLING_FIELDS = {
    name: kind
    for kind, names in (
        ("number", "temperature top_p min_p presence_penalty frequency_penalty repetition_penalty"),
        ("int", "top_k n seed min_tokens"),
        ("bool", "ignore_eos skip_special_tokens include_stop_str_in_output"),
        ("bool", "spaces_between_special_tokens"),
        ("ints", "stop_token_ids allowed_token_ids"),
        ("strs", "bad_words"),
    )
    for name in names.split()
}

_GUIDED = "guided_* fields were removed from vLLM: use 'response_format' or 'structured_outputs'"
_UNSUPPORTED = {
    "stream": "streaming is not possible in a batch file: drop 'stream' or set it to false",
    "echo": "'echo' is not supported",
    "suffix": "'suffix' is not supported",
    "prompt_logprobs": "'prompt_logprobs' is not supported by run-batch",
    "use_beam_search": "beam search is not supported by run-batch",
    **dict.fromkeys(
        ("guided_json", "guided_regex", "guided_choice", "guided_grammar"),
        _GUIDED,
    ),
}


def _check_unsupported(body: dict[str, Any]) -> None:
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise RequestError(f"{why} (got '{name}': {_describe(body[name])}).")


def _validate_prompt(ctx: ServingContext, token_ids: list[int], max_tokens: int | None) -> None:
    try:
        ctx.engine.input_processor.validate_prompt(token_ids, max_tokens)
    except ValueError as e:
        raise RequestError(str(e)) from e


def _max_tokens(
    ctx: ServingContext, prompt_len: int, requested: int | None, default: int | None
) -> int:
    """The requested max_tokens (an error if it does not fit), else the smallest default."""
    room = ctx.max_model_len - prompt_len
    if requested is None:
        generation_max = ctx.default_sampling.get("max_tokens")
        return min(v for v in (default, generation_max, room) if v is not None)
    if requested > room:
        raise RequestError(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
            f"requested {requested} output tokens and your prompt contains {prompt_len} input "
            f"tokens, for a total of {prompt_len + requested} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens."
        )
    return requested  # values < 1 are rejected by SamplingParams


def _sampling_params(
    body: dict[str, Any],
    ctx: ServingContext,
    prompt_len: int,
    requested_max: int | None,
    default_max: int | None,
    num_logprobs: int | None,
) -> SamplingParams:
    kwargs = {k: v for k, v in ctx.default_sampling.items() if k != "max_tokens"}
    for name, kind in _SAMPLING_FIELDS.items():
        value = _field(body, name, kind)
        if value is not None:
            kwargs[name] = value
    if not -(2**63) <= kwargs.get("seed", 0) < 2**63:
        raise RequestError(f"'seed' must be a 64-bit integer, got {kwargs['seed']}.")
    stop = body.get("stop")
    if stop is not None:
        kwargs["stop"] = [stop] if isinstance(stop, str) else stop
        if not _KINDS["strs"][0](kwargs["stop"]):
            raise RequestError(
                f"'stop' must be a string or a list of strings, got {_describe(stop)}"
            )
    logit_bias = _field(body, "logit_bias", "object")
    if logit_bias is not None:
        bias: dict[int, float] = {}
        for key, value in logit_bias.items():
            if not str(key).strip().lstrip("-").isdigit() or not _is_number(value):
                raise RequestError(
                    f"'logit_bias' must map token ids to numbers, got {_describe({key: value})}."
                )
            bias[int(key)] = min(100.0, max(-100.0, float(value)))
        kwargs["logit_bias"] = bias
    kwargs["max_tokens"] = _max_tokens(ctx, prompt_len, requested_max, default_max)
    kwargs["logprobs"] = num_logprobs
    kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY
    try:
        kwargs["structured_outputs"] = structured_outputs_from_body(body)
    except ValueError as e:
        raise RequestError(str(e)) from e
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError, OverflowError) as e:
        raise RequestError(str(e)) from e


def _require_generate(ctx: ServingContext, api: str) -> None:
    if "generate" not in ctx.supported_tasks:
        raise RequestError(f"This model does not support the {api} API (it is not generative).")


# ---------------------------------------------------------------- endpoints
def prepare_chat(body: dict[str, Any], ctx: ServingContext) -> PreparedRequest:
    from pagedlm.entrypoints.chat_utils import render_conversations

    _require_generate(ctx, "chat completions")
    _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"'messages' must be a non-empty list, got {_describe(messages)}.")
    bad = next((i for i, m in enumerate(messages) if not isinstance(m, dict)), None)
    if bad is not None:
        raise RequestError(f"messages[{bad}] must be an object, got {_describe(messages[bad])}.")
    if ctx.tokenizer is None:
        raise RequestError("Chat completions need a tokenizer (skip_tokenizer_init is set).")
    continue_final = bool(_field(body, "continue_final_message", "bool"))
    add_generation_prompt = _field(body, "add_generation_prompt", "bool")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final
    tools, kwargs = _field(body, "tools", "list"), _field(body, "chat_template_kwargs", "object")
    try:
        (prompt,) = render_conversations(
            ctx.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tools=tools,
            chat_template_kwargs=kwargs,
            image_placeholder=ctx.engine.image_placeholder,
            allowed_local_media_path=ctx.engine.model_config.allowed_local_media_path,
        )
    except NotImplementedError as e:  # video or audio parts
        raise RequestError(str(e)) from e
    except Exception as e:  # bad messages or images, or the template rejects the conversation
        raise RequestError(f"Cannot render the messages: {e}") from e
    prompt_len = len(prompt["prompt_token_ids"])
    logprobs = _field(body, "logprobs", "bool")
    top_logprobs = _field(body, "top_logprobs", "int")
    if top_logprobs is not None and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true.")
    num_logprobs = (top_logprobs or 0) if logprobs else None
    requested = _field(body, "max_completion_tokens", "int")
    if requested is None:
        requested = _field(body, "max_tokens", "int")
    _validate_prompt(ctx, prompt["prompt_token_ids"], requested)
    params = _sampling_params(body, ctx, prompt_len, requested, None, num_logprobs)
    role = "assistant" if add_generation_prompt else str(messages[-1].get("role", "assistant"))
    return _prepared(body, ctx, prompt, params, role, num_logprobs)


def prepare_completion(body: dict[str, Any], ctx: ServingContext) -> PreparedRequest:
    _require_generate(ctx, "completions")
    _check_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt is that prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(
            f"'prompt' holds {len(prompt)} prompts, but a batch file takes one prompt per line: "
            "write one line (with its own custom_id) per prompt."
        )
    if isinstance(prompt, str):
        add_special = _field(body, "add_special_tokens", "bool")
        kwargs = None if add_special is None else {"add_special_tokens": add_special}
        try:
            text, token_ids, _ = ctx.engine.input_processor.tokenize_prompt(prompt, kwargs)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        text, token_ids = None, [int(t) for t in prompt]
    else:
        raise RequestError(
            f"'prompt' must be a string or a list of token ids, got {_describe(prompt)}."
        )
    num_logprobs = _field(body, "logprobs", "int")
    requested = _field(body, "max_tokens", "int")
    _validate_prompt(ctx, token_ids, requested)
    params = _sampling_params(body, ctx, len(token_ids), requested, 16, num_logprobs)
    prompt_dict = TokensPrompt(prompt_token_ids=token_ids)
    if text is not None:
        prompt_dict["prompt"] = text
    return _prepared(body, ctx, prompt_dict, params, None, num_logprobs)


def _prepared(
    body: dict[str, Any],
    ctx: ServingContext,
    prompt: TokensPrompt,
    params: SamplingParams,
    role: str | None,
    num_logprobs: int | None,
) -> PreparedRequest:
    """A generation request; `role` is the chat message's role, None for a text completion."""
    as_ids = bool(_field(body, "return_tokens_as_token_ids", "bool"))
    chat = role is not None
    prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")

    def choice(c: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if num_logprobs is not None:
            steps = logprob_steps(c, ctx.tokenizer, num_logprobs, as_ids)
            logprobs = chat_logprobs(steps) if chat else completion_logprobs(steps)
        content = {"message": {"role": role, "content": c.text}} if chat else {"text": c.text}
        return {"index": c.index, **content, "logprobs": logprobs}

    return PreparedRequest(prompt, params, lambda out: response_body(prefix, obj, out, ctx, choice))


def prepare_embedding(body: dict[str, Any], ctx: ServingContext) -> PreparedRequest:
    """One input (text or token ids) -> an OpenAI embeddings body (float or base64)."""
    if "embed" not in ctx.supported_tasks:
        raise RequestError(
            "This model does not support the embeddings API; run /v1/embeddings lines with an "
            "embedding model (supported tasks of this model: "
            f"{', '.join(ctx.supported_tasks) or 'none'})."
        )
    value = body.get("input")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        prompt: dict[str, Any] = {"prompt": value}
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in value])
    else:
        raise RequestError(
            "'input' must be one non-empty string or list of token ids per line, got "
            f"{_describe(value)}."
        )
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', got {encoding!r}.")
    try:
        params = PoolingParams(
            dimensions=_field(body, "dimensions", "int"),
            truncate_prompt_tokens=_field(body, "truncate_prompt_tokens", "int"),
            use_activation=_field(body, "normalize", "bool"),
        )
    except ValueError as e:
        raise RequestError(str(e)) from e

    def make_body(output: Any) -> dict[str, Any]:
        vector = output.outputs.data.float()
        if encoding == "base64":
            embedding: Any = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
        else:
            embedding = vector.tolist()
        n = len(output.prompt_token_ids)
        return {
            "id": f"embd-{output.request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": ctx.model_name,
            "data": [{"index": 0, "object": "embedding", "embedding": embedding}],
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    return PreparedRequest(prompt, params, make_body)  # type: ignore[arg-type]


URL_HANDLERS: dict[str, Callable[[dict[str, Any], ServingContext], PreparedRequest]] = {
    "/v1/chat/completions": prepare_chat,
    "/v1/completions": prepare_completion,
    "/v1/embeddings": prepare_embedding,
}
