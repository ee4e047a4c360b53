"""EngineArgs: every engine option, as a dataclass, as `LLM(**kwargs)` and as CLI flags.

`LLM(**kwargs)` and `pagedlm ... --flags` both build EngineArgs, so an option exists in one place.
Every field vLLM's EngineArgs has exists here: pagedlm's own below, the rest from
`vllm_only_args` (accepted at vLLM's default, refused by name otherwise). Names vLLM lacks raise
TypeError (the dataclass constructor does it).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from pagedlm import envs
from pagedlm.attention.kv_cache_dtype import check_kv_cache_dtype
from pagedlm.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    WeightTransferConfig,
    derive_max_model_len,
    resolve_dtype,
)
from pagedlm.engine.arg_parser import (
    ENGINE_ARG_HELP,
    FlexibleArgumentParser,
    add_engine_cli_args,
)
from pagedlm.engine.vllm_only_args import VLLM_ONLY_ENGINE_ARGS, check_vllm_only_args

logger = logging.getLogger(__name__)

# Values accepted for options whose other values vLLM has but pagedlm refuses by name.
_ALLOWED_VALUES: dict[str, tuple[Any, ...]] = {
    "enforce_eager": (True, False),  # vLLM's default False compiles; pagedlm is always eager
    "prefix_caching_hash_algo": ("sha256",),
    "async_scheduling": (None, False),
    "distributed_executor_backend": (None, "uni", "mp", "external_launcher"),
    "quantization": (None, "gguf", "int8", "compressed-tensors"),
    "compilation_config": (None, 0, {}),
    "model_impl": ("auto", "vllm"),
    "tokenizer_mode": ("auto", "hf", "slow"),  # not vLLM's mistral / custom tokenizers
    "load_format": ("auto", "safetensors", "pt", "gguf", "dummy"),
}


_POSITIVE_INT_FIELDS = (
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
    "tensor_parallel_size", "num_gpu_blocks_override", "kv_cache_memory_bytes", "max_logprobs",
)  # fmt: skip
"""Sizes given as ints of at least 1 (None: derived); max_logprobs also takes 0 and -1."""


def _with_vllm_only_fields(cls: type) -> type:
    """Append every `VLLM_ONLY_ENGINE_ARGS` name as a field defaulting to vLLM's value (after
    pagedlm's own fields, so positional use and the CLI of those are unchanged)."""
    for name, (accepted, _) in VLLM_ONLY_ENGINE_ARGS.items():
        cls.__annotations__[name] = "Any"
        default = accepted[0]
        if isinstance(default, (list, dict, set)):
            setattr(cls, name, field(default_factory=lambda d=default: copy.copy(d), repr=False))
        else:
            setattr(cls, name, field(default=default, repr=False))
    return cls


@dataclass
@_with_vllm_only_fields
class EngineArgs:
    """Engine options with vLLM's names and (CPU) defaults."""

    model: str = "qwen2.5-coder-0.5b-instruct"
    runner: str = "auto"
    convert: str = "auto"
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    hf_token: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str = "sha256"
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    disable_log_stats: bool = False
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    enforce_eager: bool = True
    load_format: str = "auto"
    hf_overrides: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: dict[str, Any] | None = None
    async_scheduling: bool | None = None
    distributed_executor_backend: str | None = None
    compilation_config: Any = None
    enable_sleep_mode: bool = False
    model_impl: str = "auto"
    weight_transfer_config: Any = None
    profiler_config: Any = None
    structured_outputs_config: dict[str, Any] | None = None
    return_sampling_mask: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float = 4
    allowed_local_media_path: str = ""
    disable_chunked_mm_input: bool = False
    served_model_name: str | list[str] | None = None
    spec_method: str | None = None
    spec_model: str | None = None
    spec_tokens: int | None = None

    def __post_init__(self) -> None:
        check_vllm_only_args({name: getattr(self, name) for name in VLLM_ONLY_ENGINE_ARGS})
        self._fold_speculative_shorthands()
        for name, allowed in _ALLOWED_VALUES.items():
            if getattr(self, name) not in allowed:
                raise NotImplementedError(
                    f"{name}={getattr(self, name)!r} is not supported by pagedlm (accepted: "
                    f"{', '.join(map(repr, allowed))}). {ENGINE_ARG_HELP.get(name, '')}"
                )
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(
                "model must be a Hugging Face directory, a .gguf file, a packaged model name or "
                f"a hub id (a non-empty string), got {self.model!r:.60}."
            )
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if value is None and name not in ("tensor_parallel_size", "max_logprobs"):
                continue  # None: derived from the model or the machine
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
            if value < 1 and not (name == "max_logprobs" and value in (0, -1)):
                hint = ENGINE_ARG_HELP.get(name, "")
                raise ValueError(f"{name} must be at least 1, got {value}. {hint}".rstrip())
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.convert not in ("auto", "none", "embed", "classify"):
            raise ValueError(
                f"convert must be auto, none, embed or classify, got {self.convert!r}."
            )
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}."
            )
        modes = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
        if self.logprobs_mode not in modes:
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r} is not one of {', '.join(modes)}."
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )

    def _multimodal_config(self, hf_config: Any) -> MultiModalConfig | None:
        """The image options of a vision-language model; on a text-only model they must be
        left at their defaults (images are refused per request)."""
        if getattr(hf_config, "vision_config", None) is None:
            if self.limit_mm_per_prompt or self.mm_processor_kwargs:
                raise ValueError(
                    "limit_mm_per_prompt and mm_processor_kwargs apply to vision-language models; "
                    "this model is text-only."
                )
            return None
        return MultiModalConfig(
            limit_per_prompt=dict(self.limit_mm_per_prompt or {}),
            mm_processor_kwargs=dict(self.mm_processor_kwargs or {}),
            mm_processor_cache_gb=float(self.mm_processor_cache_gb),
        )

    def _fold_speculative_shorthands(self) -> None:
        """vLLM's `spec_method` / `spec_model` / `spec_tokens` fill `speculative_config`."""
        keys = {
            "spec_method": "method",
            "spec_model": "model",
            "spec_tokens": "num_speculative_tokens",
        }
        given = {
            key: getattr(self, name)
            for name, key in keys.items()
            if getattr(self, name) is not None
        }
        if given:
            self.speculative_config = {**(self.speculative_config or {}), **given}
            self.spec_method = self.spec_model = self.spec_tokens = None

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--kebab-case` flag per field (booleans get `--no-` forms too)."""
        return add_engine_cli_args(parser, EngineArgs, VLLM_ONLY_ENGINE_ARGS)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})

    # --------------------------------------------------------------- config
    def create_engine_config(self) -> VllmConfig:
        """Resolve the model, dtype, lengths and batch defaults into a VllmConfig."""
        from pagedlm.model_loader.resolve import load_hf_config, resolve_model

        resolved = resolve_model(self.model, revision=self.revision, hf_token=self.hf_token)
        hf_config = load_hf_config(resolved, trust_remote_code=self.trust_remote_code)
        for key, value in (self.hf_overrides or {}).items():
            setattr(hf_config, key, value)
        checkpoint_dtype = getattr(hf_config, "dtype", None)  # `torch_dtype` before 4.56
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(__import__("torch"), checkpoint_dtype, None)
        dtype = resolve_dtype(self.dtype, checkpoint_dtype)
        quantization = self.resolve_quantization(resolved.gguf_file is not None, hf_config)

        derived = derive_max_model_len(hf_config)
        max_model_len = self.max_model_len or derived
        if max_model_len > derived:
            raise ValueError(
                f"max_model_len={max_model_len} is longer than the model allows ({derived}, from "
                "its config). Pass a smaller --max-model-len."
            )
        from pagedlm.models.registry import ModelRegistry

        archs = getattr(hf_config, "architectures", None) or [""]
        model_cls, runner, pooling_task = ModelRegistry.resolve_model_cls(
            archs[0], self.runner, self.convert
        )
        pooling = runner == "pooling"
        # Pooling requests are computed whole in one step (encoders attend bidirectionally,
        # MEAN / CLS pooling reads every row), except a causal decoder's LAST pooling (as vLLM)
        whole_prompts = pooling and not model_cls.supports_chunked_pooling
        chunked = not whole_prompts and self.enable_chunked_prefill is not False
        prefix_caching = not whole_prompts and self.enable_prefix_caching is not False
        max_batched = self.max_num_batched_tokens or 4096
        if not chunked:
            if max_batched < max_model_len and self.max_num_batched_tokens is not None:
                why = (
                    "this model takes each prompt whole"
                    if whole_prompts
                    else "chunked prefill is off"
                )
                raise ValueError(
                    f"max_num_batched_tokens={max_batched} is smaller than max_model_len="
                    f"{max_model_len} and {why}, so a longer prompt could never be scheduled. "
                    "Raise max_num_batched_tokens or lower max_model_len."
                )
            max_batched = max(max_batched, max_model_len)
        model_config = ModelConfig(
            model=self.model,
            model_path=resolved.path,
            tokenizer=self.tokenizer or resolved.tokenizer_path,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision,
            trust_remote_code=self.trust_remote_code,
            skip_tokenizer_init=self.skip_tokenizer_init,
            tokenizer_mode=self.tokenizer_mode,
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            generation_config=self.generation_config,
            override_generation_config=dict(self.override_generation_config or {}),
            load_format=self.load_format,
            enforce_eager=self.enforce_eager,
            gguf_file=resolved.gguf_file,
            quantization=quantization,
            runner_type=runner,
            runner=self.runner,
            convert=self.convert,
            pooling_task=pooling_task,
            return_sampling_mask=self.return_sampling_mask,
            multimodal_config=self._multimodal_config(hf_config),
            allowed_local_media_path=self.allowed_local_media_path,
        )
        cache_config = CacheConfig(
            block_size=self.block_size or 16,
            enable_prefix_caching=prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes
            if self.kv_cache_memory_bytes is not None or envs.VLLM_CPU_KVCACHE_SPACE is None
            else int(envs.VLLM_CPU_KVCACHE_SPACE * 2**30),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs or 256,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            scheduling_policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            # a model whose image tokens attend both ways needs each image in one chunk
            disable_chunked_mm_input=self.disable_chunked_mm_input or model_cls.mm_bidirectional,
        )
        parallel_config = self.create_parallel_config(hf_config)
        if model_config.multimodal_config is not None and (
            self.speculative_config or self.enable_lora
        ):
            raise NotImplementedError(
                "Speculative decoding and LoRA adapters on vision-language models are not "
                "supported by pagedlm yet."
            )
        speculative_config = None
        if self.speculative_config:
            if pooling:
                raise ValueError("speculative decoding needs a generative model")
            speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if speculative_config.method == "draft_model":
                speculative_config.draft_model_config = self._draft_model_config(
                    speculative_config, model_config, parallel_config
                )
                scheduler_config.num_lookahead_tokens = speculative_config.num_speculative_tokens
            if self.return_sampling_mask:
                raise ValueError("return_sampling_mask is not supported with speculative decoding.")
        return VllmConfig(
            model_config,
            cache_config,
            scheduler_config,
            parallel_config=parallel_config,
            speculative_config=speculative_config,
            disable_log_stats=self.disable_log_stats,
            weight_transfer_config=self._weight_transfer_config(),
            profiler_config=ProfilerConfig.from_any(self.profiler_config),
            enable_sleep_mode=self.enable_sleep_mode,
            structured_outputs_config=StructuredOutputsConfig.from_any(
                self.structured_outputs_config
            ),
            lora_config=self._lora_config(pooling),
        )

    def _lora_config(self, pooling: bool) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if pooling:
            raise NotImplementedError(
                "enable_lora=True with a pooling model is not supported by pagedlm yet "
                "(LoRA adapters run on generative models)."
            )
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _weight_transfer_config(self) -> WeightTransferConfig | None:
        value = self.weight_transfer_config
        if value is None or isinstance(value, WeightTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "weight_transfer_config must be a WeightTransferConfig or a dict like "
                f"{{'backend': 'gloo'}}, got {type(value).__name__}."
            )
        try:
            return WeightTransferConfig(**value)
        except TypeError as e:
            raise ValueError(f"Invalid weight_transfer_config: {e}") from e

    def _draft_model_config(
        self, spec: SpeculativeConfig, target: ModelConfig, parallel: ParallelConfig
    ) -> ModelConfig:
        """The draft model: same tokenizer, vocabulary, dtype and length limit as the target."""
        from pagedlm.model_loader.resolve import load_hf_config, resolve_model

        if parallel.world_size > 1:
            raise NotImplementedError(
                "speculative decoding with a draft model under tensor parallelism is not "
                "supported by pagedlm yet (n-gram drafts are)."
            )
        assert spec.model is not None
        resolved = resolve_model(spec.model, revision=None, hf_token=self.hf_token)
        hf_config = load_hf_config(resolved, trust_remote_code=self.trust_remote_code)
        if int(hf_config.vocab_size) != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({hf_config.vocab_size} tokens) differs from the "
                f"target's ({target.vocab_size}): a draft model must share the tokenizer."
            )
        if derive_max_model_len(hf_config) < target.max_model_len:
            raise ValueError(
                f"the draft model allows {derive_max_model_len(hf_config)} positions, fewer than "
                f"max_model_len={target.max_model_len}; pass a smaller --max-model-len."
            )
        return dataclasses.replace(
            target,
            model=spec.model,
            model_path=resolved.path,
            hf_config=hf_config,
            gguf_file=resolved.gguf_file,
            quantization=self.resolve_quantization(resolved.gguf_file is not None, hf_config),
        )

    def resolve_quantization(self, is_gguf: bool, hf_config: Any = None) -> str | None:
        """GGUF files default to "gguf" (PAGEDLM_GGUF_DEQUANTIZE=1: dequantized at load
        instead); "int8" needs a bf16/fp32 checkpoint, "gguf" a GGUF file. A checkpoint whose
        config names a quantization method gets that one (vLLM's rule), if pagedlm runs it."""
        if is_gguf:
            if self.quantization not in (None, "gguf"):
                raise ValueError(
                    f"quantization={self.quantization!r} is for Hugging Face checkpoints; this "
                    "model is a GGUF file, already quantized: use quantization='gguf' (its "
                    "default)."
                )
            if self.quantization is None and envs.PAGEDLM_GGUF_DEQUANTIZE:
                return None
            return "gguf"
        if self.quantization == "gguf":
            raise ValueError(
                "quantization='gguf' needs a .gguf model file; for a safetensors checkpoint "
                "use quantization='int8' or None."
            )
        from pagedlm.layers.quantization import compressed_tensors

        in_checkpoint = compressed_tensors.checkpoint_quant_method(hf_config)
        if in_checkpoint is None:
            if self.quantization == compressed_tensors.QUANT_METHOD:
                raise ValueError(
                    "quantization='compressed-tensors' but the checkpoint's config has no "
                    "quantization_config: pass quantization=None or 'int8'."
                )
            return self.quantization
        if self.quantization not in (None, in_checkpoint):
            raise ValueError(
                f"the checkpoint is quantized with {in_checkpoint!r} (its config's "
                f"quantization_config) but quantization={self.quantization!r} was passed: "
                "pass quantization=None to use the checkpoint's."
            )
        if in_checkpoint != compressed_tensors.QUANT_METHOD:
            raise NotImplementedError(
                f"checkpoints quantized with {in_checkpoint!r} do not load in pagedlm; it runs "
                "'compressed-tensors' int8 W8A8 checkpoints, GGUF files, and quantization='int8' "
                "on bf16/fp32 checkpoints."
            )
        compressed_tensors.check_config(hf_config)
        return in_checkpoint

    def create_parallel_config(self, hf_config: Any) -> ParallelConfig:
        """Check that the model shards over `tensor_parallel_size` ranks; pick the executor."""
        if self.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size}: data-parallel engines are "
                "separate processes in pagedlm; start one per rank with VLLM_DP_RANK / "
                "VLLM_DP_SIZE set (see examples/data_parallel.py)."
            )
        tp = self.tensor_parallel_size
        text_config = getattr(hf_config, "text_config", None) or hf_config
        heads = getattr(text_config, "num_attention_heads", 1)
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        if heads % tp:
            raise ValueError(
                f"Total number of attention heads ({heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(
                f"Total number of key/value heads ({kv_heads}) and tensor parallel size ({tp}) "
                "must divide one another (KV heads are replicated when fewer than ranks)."
            )
        backend = self.distributed_executor_backend or ("mp" if tp > 1 else "uni")
        if backend == "external_launcher":
            # One engine per caller process (TRL colocate): with one rank that is the in-process
            # executor; ranks sharing the caller's process group are not implemented.
            if tp > 1:
                raise NotImplementedError(
                    "distributed_executor_backend='external_launcher' with "
                    "tensor_parallel_size > 1 is not supported by pagedlm (use 'mp')."
                )
            backend = "uni"
        if backend == "uni" and tp > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one rank; tensor_parallel_size > 1 "
                "needs 'mp' (the default)."
            )
        return ParallelConfig(
            tensor_parallel_size=tp,
            data_parallel_size=max(1, envs.VLLM_DP_SIZE),
            data_parallel_rank=envs.VLLM_DP_RANK,
            distributed_executor_backend=backend,
        )


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs of the asynchronous engine: adds vLLM's request-logging switch."""

    enable_log_requests: bool = False


__all__ = ["AsyncEngineArgs", "EngineArgs", "FlexibleArgumentParser"]
