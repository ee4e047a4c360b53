"""Turn a user prompt + params into a validated engine request (tokenize, check, clone params).

Errors are raised here, before anything runs: empty prompts, ids out of vocabulary, prompts
that do not fit `max_model_len`, invalid sampling parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedlm.config import ModelConfig
from pagedlm.exceptions import VLLMValidationError
from pagedlm.multimodal.inputs import MultiModalFeatureSpec
from pagedlm.multimodal.processing import (
    BaseMultiModalProcessor,
    ProcessorCache,
    check_mm_data,
)
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_options import check_unsupported_fields, is_int
from pagedlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.structured_output import StructuredOutputManager


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: Any = None
    token_type_ids: list[int] | None = None
    lora_request: Any = None  # LoRARequest, checked by the engine
    mm_features: list[MultiModalFeatureSpec] | None = None  # images, in prompt order


def _check_token_ids(token_ids: Any) -> list[int]:
    """The prompt's token ids as a list of ints; TypeError for anything else (a float or a
    bool is no token id)."""
    if not isinstance(token_ids, list | tuple):
        raise TypeError(f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}.")
    for i, t in enumerate(token_ids):
        if not is_int(t):
            raise TypeError(
                f"prompt token ids must be ints, got {type(t).__name__} {t!r:.20} at position {i}."
            )
    return [int(t) for t in token_ids]


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Any, speculative: bool = False
    ) -> None:
        self.model_config = model_config
        self.speculative = speculative
        self.tokenizer = tokenizer
        self.generation_config = model_config.get_hf_generation_config()
        self.structured_output_manager: StructuredOutputManager | None = None
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer else None
        if self.eos_token_id is None:
            eos = self.generation_config.get("eos_token_id")
            self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        self.mm_processor: BaseMultiModalProcessor | None = None
        mm_config = model_config.multimodal_config
        if mm_config is not None:
            from pagedlm.models.registry import ModelRegistry

            model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)[0]
            cache = ProcessorCache(int(mm_config.mm_processor_cache_gb * 2**30))
            self.mm_processor = model_cls.mm_processor_cls(model_config, tokenizer, cache)

    def process_multimodal(
        self, prompt: dict[str, Any], token_ids: list[int]
    ) -> tuple[list[int], list[MultiModalFeatureSpec] | None]:
        """The prompt's token ids with its images' placeholders expanded, and their features
        (None for a prompt without images)."""
        mm_config = self.model_config.multimodal_config
        if mm_config is None and prompt.get("mm_processor_kwargs"):
            raise ValueError(
                "mm_processor_kwargs apply to vision-language models; this model is text-only."
            )
        images = check_mm_data(
            prompt.get("multi_modal_data") or {},
            mm_config.limit_per_prompt if mm_config else {},
            self.mm_processor is not None,
        )
        if not images:
            return token_ids, None
        assert self.mm_processor is not None and mm_config is not None
        kwargs = {**mm_config.mm_processor_kwargs, **(prompt.get("mm_processor_kwargs") or {})}
        uuids = (prompt.get("multi_modal_uuids") or {}).get("image")
        token_ids, features = self.mm_processor.apply(token_ids, images, kwargs, uuids)
        return token_ids, features

    def stop_token_ids(self) -> list[int]:
        """The ids that end generation by default: EOS and generation_config's eos ids."""
        ids = self.generation_config.get("eos_token_id")
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.eos_token_id is not None:
            ids.insert(0, self.eos_token_id)
        return list(dict.fromkeys(ids))

    def tokenize_prompt(
        self, prompt: Any, tokenization_kwargs: dict[str, Any] | None = None
    ) -> tuple[str | None, list[int], str | None]:
        """(prompt text, prompt token ids, cache salt) of one prompt in any accepted form."""
        cache_salt = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                token_ids = _check_token_ids(prompt["prompt_token_ids"])
                return prompt.get("prompt"), token_ids, cache_salt
            if "prompt_embeds" in prompt:
                raise NotImplementedError("prompt_embeds prompts are not supported by pagedlm.")
            if "prompt" not in prompt:
                raise ValueError(
                    f"A prompt dict needs 'prompt' or 'prompt_token_ids', got keys {list(prompt)}"
                )
            prompt = prompt["prompt"]
        if isinstance(prompt, list | tuple):
            return None, _check_token_ids(prompt), cache_salt
        if not isinstance(prompt, str):
            raise TypeError(
                "A prompt must be a string, a list of token ids or a prompt dict, got "
                f"{type(prompt).__name__}: {prompt!r:.80}"
            )
        if self.tokenizer is None:
            raise ValueError(
                "Text prompts are not allowed when `skip_tokenizer_init=True`; pass "
                "{'prompt_token_ids': [...]} instead."
            )
        kwargs = dict(tokenization_kwargs or {})
        truncate = kwargs.pop("truncate_prompt_tokens", None)
        kwargs.setdefault("add_special_tokens", True)
        token_ids = self.tokenizer.encode(prompt, **kwargs)
        if truncate is not None and truncate >= 0:
            token_ids = token_ids[-truncate:] if truncate else []
        return prompt, token_ids, cache_salt

    def validate_prompt_vocab(self, prompt_token_ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary")

    def validate_prompt(self, prompt_token_ids: list[int], max_tokens: int | None = None) -> None:
        """A non-empty in-vocabulary prompt shorter than max_model_len (`max_tokens`, the
        requested output tokens, only goes into the message)."""
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        self.validate_prompt_vocab(prompt_token_ids)
        max_len = self.model_config.max_model_len
        n = len(prompt_token_ids)
        if n > max_len:
            out = max_tokens or 0
            raise VLLMValidationError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {out} output tokens and your prompt contains {n} input tokens, for "
                f"a total of {n + out} tokens. Please reduce the length of the input prompt or "
                "the number of requested output tokens.",
                parameter="prompt",
                value=n,
            )
        if n == max_len:
            raise ValueError(
                f"The decoder prompt (length {n}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {max_len}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens (prompt + "
                "requested output tokens)."
            )

    def process_inputs(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> EngineCoreRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}."
            )
        text, token_ids, cache_salt = self.tokenize_prompt(prompt, tokenization_kwargs)
        mm_features = None
        if isinstance(prompt, dict) and (
            prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs")
        ):
            token_ids, mm_features = self.process_multimodal(prompt, token_ids)
        self.validate_prompt(token_ids, params.max_tokens)
        params = self.prepare_sampling_params(params, len(token_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            mm_features=mm_features,
        )

    def process_pooling_inputs(
        self,
        request_id: str,
        prompt: Any,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> EngineCoreRequest:
        """Tokenize (truncating only when asked) and validate one pooling request."""
        task = self.model_config.pooling_task
        params = params.clone()
        config = self.model_config
        params.verify(
            task or "embed",
            is_matryoshka=config.is_matryoshka,
            hidden_size=config.get_hidden_size(),
        )
        kwargs = dict(tokenization_kwargs or {})
        truncate = kwargs.pop("truncate_prompt_tokens", params.truncate_prompt_tokens)
        max_len = self.model_config.max_model_len
        if truncate is not None and truncate < 0:
            truncate = max_len
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if isinstance(prompt, str) and truncate is not None and self.tokenizer is not None:
            encoded = self.tokenizer(prompt, truncation=True, max_length=truncate, **kwargs)
            text, token_ids = prompt, list(encoded["input_ids"])
            cache_salt = None
        else:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise NotImplementedError(
                    "Images in pooling requests (embed, classify, score) are not supported by "
                    "pagedlm; images work with generate and chat."
                )
            text, token_ids, cache_salt = self.tokenize_prompt(prompt, kwargs)
            if truncate is not None and len(token_ids) > truncate:
                token_ids = token_ids[-truncate:]
                if token_type_ids is not None:
                    token_type_ids = token_type_ids[-truncate:]
        if not token_ids:
            raise ValueError("The prompt cannot be empty")
        if len(token_ids) > max_len:
            raise VLLMValidationError(
                f"This model's maximum context length is {max_len} tokens. However, your input "
                f"contains {len(token_ids)} tokens. Shorten the input, or pass "
                "truncate_prompt_tokens (tokenization_kwargs={'truncate_prompt_tokens': k}) to "
                "keep only the last k tokens.",
                parameter="prompt",
                value=len(token_ids),
            )
        self.validate_prompt_vocab(token_ids)
        return EngineCoreRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            sampling_params=None,
            eos_token_id=None,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=params,
            token_type_ids=token_type_ids,
        )

    def prepare_sampling_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Engine-time checks of a SamplingParams (process_inputs checked its type) and the
        engine's copy of it, completed from the model's generation config."""
        params.check_types()  # again: fields may have been set after construction
        params._verify_args()
        check_unsupported_fields(params)
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {params.seed}.")
        params.verify(
            max_logprobs=self.model_config.max_logprobs, vocab_size=self.model_config.vocab_size
        )
        if self.speculative and params.structured_outputs is not None:
            raise ValueError("Structured outputs are not yet supported with speculative decoding.")
        if self.speculative and (params.min_p > 0.0 or params.logit_bias):
            raise ValueError(
                "The min_p and logit_bias sampling parameters are not yet supported with "
                "speculative decoding."
            )
        params = params.clone()
        params.normalize_for_engine(self.model_config.vocab_size)
        if params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("Structured outputs need an engine (no manager was set).")
            self.structured_output_manager.validate(params.structured_outputs)
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - prompt_len
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        if params.bad_words and self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        if params.detokenize and self.tokenizer is None:
            params.detokenize = False
        return params
