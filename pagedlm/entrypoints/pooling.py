"""LLM's pooling methods: encode, embed, classify, score (vLLM's PoolingOfflineMixin).

Requests go through the same scheduler as generation (prefill-only, whole prompt in one step,
no KV kept after).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pagedlm.inputs import TokensPrompt, prompt_to_seq
from pagedlm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagedlm.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine

_EMBED_ERROR = (
    "Embedding API is not supported by this model. Try converting the model using "
    "`--convert embed`."
)
_CLASSIFY_ERROR = (
    "Classification API is not supported by this model. Try converting the model using "
    "`--convert classify`."
)
# vLLM's messages (its pooling tests match them) for a task the model lacks
_TASK_ERRORS = {
    "embed": _EMBED_ERROR,
    "token_embed": _EMBED_ERROR,
    "classify": _CLASSIFY_ERROR,
    "token_classify": _CLASSIFY_ERROR,
    "plugin": "No IOProcessor plugin installed. Please refer to the documentation and to the "
    "'prithvi_geospatial_mae_io_processor' offline inference example for more details.",
}


class PoolingMixin:
    llm_engine: LLMEngine
    runner_type: str

    def _check_pooling(self, method: str) -> None:
        if self.runner_type != "pooling":
            raise ValueError(
                f"{method} is only supported for pooling models. Try passing `--runner pooling` "
                "to use the model as a pooling model."
            )

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        self._check_pooling("LLM.encode()")
        if pooling_task is None:
            raise ValueError(
                "pooling_task required for `LLM.encode`: use LLM.embed(...) for embeddings, "
                "LLM.classify(...) for classification, LLM.score(...) for scoring, or pass "
                "pooling_task='embed' | 'classify'."
            )
        supported = self.llm_engine.get_supported_tasks()
        if isinstance(prompts, dict) and "data" in prompts:  # an IO-processor plugin's input
            raise ValueError(_TASK_ERRORS["plugin"])
        base_task = pooling_task.removeprefix("token_")
        if base_task != pooling_task and base_task in supported:
            raise NotImplementedError(
                f"pooling_task={pooling_task!r} (one output per token) is not supported by "
                f"pagedlm yet; pooling_task={base_task!r} pools each prompt."
            )
        if pooling_task not in supported:
            raise ValueError(_TASK_ERRORS.get(pooling_task, f"Unsupported task: {pooling_task!r}"))
        if pooling_params is None:
            pooling_params = PoolingParams()
        param_list = pooling_params if isinstance(pooling_params, Sequence) else [pooling_params]
        for p in param_list:
            if p.task is not None and p.task != pooling_task:
                raise ValueError(f"You cannot overwrite {p.task=!r} with {pooling_task=!r}!")
        self._add_requests(  # type: ignore[attr-defined]
            prompts, pooling_params, use_tqdm, lora_request, None, tokenization_kwargs
        )
        return self._run_engine(use_tqdm=use_tqdm)  # type: ignore[attr-defined]

    def embed(
        self,
        prompts: Any,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        self._check_pooling("LLM.embed()")
        outs = self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="embed",
            tokenization_kwargs=tokenization_kwargs,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: Any,
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        self._check_pooling("LLM.classify()")
        outs = self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="classify",
            tokenization_kwargs=tokenization_kwargs,
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts: Any, /, **kwargs: Any) -> list[PoolingRequestOutput]:
        raise NotImplementedError(
            "LLM.reward (token_classify pooling) is not supported by pagedlm; it is deprecated "
            "in vLLM too."
        )

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """1->1, 1->N or N->N scores: a cross-encoder's relevance, or embedding cosine."""
        self._check_pooling("LLM.score()")
        tasks = self.llm_engine.get_supported_tasks()
        config = self.llm_engine.model_config
        if "score" not in tasks:
            if config.pooling_task == "classify":
                raise ValueError("Scoring API is only enabled for num_labels == 1.")
            raise ValueError("This model does not support the Scoring API.")
        extra = (pooling_params.extra_kwargs if pooling_params is not None else None) or {}
        left, right = (
            truncated(prompt_to_seq(data), self.llm_engine, name, extra.get(name, 0))
            for data, name in ((data_1, "max_tokens_per_query"), (data_2, "max_tokens_per_doc"))
        )
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ValueError(
                f"score() takes one data_1 item or as many as data_2 ({len(right)}), "
                f"got {len(left)}."
            )
        if config.pooling_task == "embed":
            return self._score_bi_encoder(
                left, right, use_tqdm, pooling_params, tokenization_kwargs
            )
        tokenizer = self.llm_engine.get_tokenizer()
        pairs = []
        for a, b in zip(left, right, strict=True):
            encoded = tokenizer(a, b, **(tokenization_kwargs or {}))
            pairs.append(
                TokensPrompt(
                    prompt_token_ids=list(encoded["input_ids"]),
                    token_type_ids=list(
                        encoded.get("token_type_ids") or [0] * len(encoded["input_ids"])
                    ),
                )
            )
        outs = self.encode(pairs, pooling_params, use_tqdm=use_tqdm, pooling_task="classify")
        return [ScoringRequestOutput.from_base(o) for o in outs]

    def _score_bi_encoder(self, left, right, use_tqdm, pooling_params, tokenization_kwargs):
        texts = list(dict.fromkeys([*left, *right]))
        embeds = self.encode(
            texts,
            pooling_params,
            use_tqdm=use_tqdm,
            pooling_task="embed",
            tokenization_kwargs=tokenization_kwargs,
        )
        by_text = {t: o for t, o in zip(texts, embeds, strict=True)}
        outs = []
        for i, (a, b) in enumerate(zip(left, right, strict=True)):
            ea, eb = by_text[a], by_text[b]
            score = F.cosine_similarity(ea.outputs.data.float(), eb.outputs.data.float(), dim=0)
            base = PoolingRequestOutput(
                str(i),
                PoolingOutput(torch.tensor([score.item()])),
                ea.prompt_token_ids + eb.prompt_token_ids,
                0,
                True,
            )
            outs.append(ScoringRequestOutput.from_base(base))
        return outs


def truncated(texts: list[Any], engine: LLMEngine, name: str, limit: Any) -> list[Any]:
    """``texts`` with each string cut to ``limit`` tokens (0: unchanged), as vLLM's
    ``PoolingParams(extra_kwargs={"max_tokens_per_query" | "max_tokens_per_doc": limit})``."""
    max_len = engine.model_config.max_model_len
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {limit!r}.")
    if limit >= max_len:
        raise ValueError(f"{name} ({limit}) must be less than max_model_len ({max_len}).")
    if not limit:
        return list(texts)
    tokenizer = engine.get_tokenizer()
    return [
        truncate_text_to_tokens(t, tokenizer, limit) if isinstance(t, str) else t for t in texts
    ]


def truncate_text_to_tokens(text: str, tokenizer: Any, max_tokens: int) -> str:
    """The longest prefix of ``text`` cut at a token boundary that encodes (without special
    tokens) to at most ``max_tokens`` tokens; the cut is a character offset of the original
    text, so no decode round trip changes it."""
    while text:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        if len(encoding["input_ids"]) <= max_tokens:
            break
        # end of the last kept token, or the start of the first dropped one if that is sooner
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[: min(end, len(text) - 1)]  # always shorter: the loop ends
    return text
