"""Resolved engine configuration: what EngineArgs turns into, read by every component.

Invariants: `max_model_len` never exceeds what the model's positions allow; the scheduler's
token budget is at least `max_model_len` when chunked prefill is off.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedlm import envs
from pagedlm.model_arch import ModelArchQueries

logger = logging.getLogger(__name__)

_STR_TO_DTYPE = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
# Keys of generation_config.json that become default SamplingParams (vLLM's list).
_GENERATION_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    from pagedlm.platforms import current_platform

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return current_platform.default_dtype(checkpoint_dtype)
    if dtype not in _STR_TO_DTYPE:
        raise ValueError(
            f"Unknown dtype {dtype!r}; use one of: auto, {', '.join(sorted(_STR_TO_DTYPE))}."
        )
    return _STR_TO_DTYPE[dtype]


def derive_max_model_len(hf_config: Any) -> int:
    """The longest sequence the model's positions allow (max_position_embeddings and friends;
    a vision-language config's text config holds them)."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return 2048


@dataclass
class MultiModalConfig:
    """Image inputs of a vision-language model (vLLM's names); None on text-only models."""

    limit_per_prompt: dict[str, int] = field(default_factory=dict)  # modality -> most items
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # image processor kwargs
    mm_processor_cache_gb: float = 4.0  # processed images kept by content hash; 0: none

    def __post_init__(self) -> None:
        for modality, limit in self.limit_per_prompt.items():
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt[{modality!r}] must be a non-negative int, got {limit!r}."
                )
        if self.mm_processor_cache_gb < 0:
            raise ValueError(
                f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb}."
            )


@dataclass
class ModelConfig(ModelArchQueries):
    """The model, its tokenizer, dtype and length limit."""

    model: str
    model_path: str
    tokenizer: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    seed: int | None = 0
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    tokenizer_mode: str = "auto"
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    load_format: str = "auto"
    enforce_eager: bool = True
    gguf_file: str | None = None
    quantization: str | None = None  # linear method: None, "gguf" or "int8"
    runner_type: str = "generate"  # resolved: "generate" or "pooling"
    runner: str = "auto"  # as requested
    convert: str = "auto"
    pooling_task: str | None = None  # "embed" or "classify" for pooling models
    return_sampling_mask: bool = False  # CompletionOutput.sampling_mask for every request
    multimodal_config: MultiModalConfig | None = None  # set for vision-language models
    allowed_local_media_path: str = ""  # file:// images are read only under this directory

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.runner_type == "generate":
            return ("generate",)
        tasks: tuple[str, ...] = (self.pooling_task,) if self.pooling_task else ()
        if self.pooling_task == "embed" or getattr(self.hf_config, "num_labels", 0) == 1:
            tasks += ("score",)
        return tasks

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    def get_hf_generation_config(self) -> dict[str, Any]:
        """generation_config.json of the model (or of the folder given), {} for 'vllm'. Without
        the file the model config's EOS id stands in, as in vLLM (a GGUF file's
        tokenizer.ggml.eos_token_id, e.g. <|im_end|> where the tokenizer's is <|endoftext|>)."""
        if self.generation_config == "vllm":
            return {}
        folder = self.model_path if self.generation_config == "auto" else self.generation_config
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            eos = getattr(self.hf_config, "eos_token_id", None)
            if eos is None:
                eos = getattr(self.hf_text_config, "eos_token_id", None)
            return {} if eos is None else {"eos_token_id": eos}
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            logger.warning("Ignoring unreadable %s: %s", path, e)
            return {}

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults the model asks for, as SamplingParams keyword arguments."""
        config = {**self.get_hf_generation_config(), **self.override_generation_config}
        diff = {
            ours: config[theirs]
            for theirs, ours in _GENERATION_KEYS.items()
            if config.get(theirs) is not None
        }
        if diff:
            logger.info("Default sampling parameters from the model: %s", diff)
        return diff


@dataclass
class CacheConfig:
    """Paged KV cache: `num_gpu_blocks` is filled in once memory is measured."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8 cache: k/v scales from the first batch (vLLM's)
    num_gpu_blocks: int | None = None


@dataclass
class SchedulerConfig:
    """One token budget per step; chunked prefill lets any prompt share a step with decodes."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    # KV slots reserved past the scheduled tokens (a draft model writes its drafts' KV there)
    num_lookahead_tokens: int = 0
    # an image's placeholder tokens are scheduled in one step, never cut by a chunk
    disable_chunked_mm_input: bool = False


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``LoRAConfig``): `max_loras` adapters per step (worker
    slots), `max_cpu_loras` loaded adapters kept in host memory (LRU), ranks up to
    `max_lora_rank`."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """Engine-level options (vLLM's ``StructuredOutputsConfig``); only xgrammar is built in."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsConfig:
        """From None, a config, or a dict (unknown keys are dropped, as vLLM does)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"structured_outputs_config must be a dict, got {type(value)}")
        known = {k: v for k, v in value.items() if k in cls.__dataclass_fields__}
        config = cls(**known)
        if config.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"structured_outputs_config backend {config.backend!r} is not available; "
                f"pagedlm supports {', '.join(STRUCTURED_OUTPUT_BACKENDS)}."
            )
        if config.reasoning_parser or config.enable_in_reasoning:
            raise NotImplementedError(
                "structured_outputs_config reasoning_parser / enable_in_reasoning are not "
                "supported by pagedlm yet (it has no reasoning parsers); leave them unset."
            )
        return config


@dataclass
class ParallelConfig:
    """How many ranks run the model and how they are started.

    `world_size` = tensor_parallel_size (pipeline parallelism is refused). Data-parallel
    ranks are separate engine processes (see examples/data_parallel.py): each engine knows its
    rank only to report it.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    distributed_executor_backend: str = "uni"  # "uni": in this process; "mp": one per rank

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


_SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: propose `num_speculative_tokens` draft tokens per decode, verify
    them in one forward of the target model, keep the longest accepted prefix plus one token.

    `method="ngram"` looks the drafts up in the request's own tokens (prompt lookup: the
    latest earlier occurrence of its last `prompt_lookup_max`..`prompt_lookup_min` tokens);
    `"draft_model"` runs the smaller `model` (same tokenizer).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_model_config: ModelConfig | None = None  # resolved from `model` by EngineArgs

    @staticmethod
    def from_dict(config: dict[str, Any]) -> SpeculativeConfig:
        config = dict(config)
        method = config.pop("method", None) or ("draft_model" if config.get("model") else None)
        if method not in _SPEC_METHODS:
            raise NotImplementedError(
                f"speculative_config method={method!r} is not supported by pagedlm (supported: "
                f"{', '.join(_SPEC_METHODS)})."
            )
        known = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = set(config) - known
        if unknown:
            raise NotImplementedError(
                f"speculative_config keys {sorted(unknown)} are not supported by pagedlm "
                f"(supported: method, {', '.join(sorted(known))})."
            )
        spec = SpeculativeConfig(method=method, **config)
        if spec.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {spec.num_speculative_tokens}."
            )
        if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{spec.prompt_lookup_min} and {spec.prompt_lookup_max}."
            )
        if method == "draft_model" and not spec.model:
            raise ValueError("speculative_config method='draft_model' needs a 'model'.")
        return spec


@dataclass
class WeightTransferConfig:
    """How a trainer's weights reach the workers: "ipc" (shared-memory tensors, one machine)
    or "gloo" (a torch.distributed group between the trainer and every worker)."""

    backend: str = "ipc"

    def __post_init__(self) -> None:
        if self.backend not in ("ipc", "gloo"):
            hint = " (NCCL needs CUDA; on CPU use 'gloo')" if self.backend == "nccl" else ""
            raise ValueError(
                f"WeightTransferConfig(backend={self.backend!r}) is not available{hint}; "
                "use 'ipc' or 'gloo'."
            )


@dataclass
class ProfilerConfig:
    """vLLM's profiler options; only the torch profiler exists on CPU.

    Iteration windows (worker/profiler.py): `delay_iterations` steps skipped after
    start_profile(), at most `max_iterations` recorded (0: until stop_profile()), and with
    `wait_iterations` / `warmup_iterations` a torch.profiler schedule recording
    `active_iterations` steps. `ignore_frontend`: pagedlm runs no separate front-end profiler
    (vLLM's AsyncLLM server has one); the in-process engine's trace covers its thread.

    `torch_profiler_dir` set (here or by VLLM_TORCH_PROFILER_DIR) with `profiler=None`
    selects "torch". Traces are Chrome trace JSON (gzipped when `torch_profiler_use_gzip`).
    """

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    capture_torch_profiler: bool = False
    detailed_trace_annotation: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    def __post_init__(self) -> None:
        if self.profiler is None and self.torch_profiler_dir:
            self.profiler = "torch"
        if self.profiler not in (None, "torch"):
            raise ValueError(
                f"ProfilerConfig(profiler={self.profiler!r}) is not available on CPU; use 'torch'."
            )
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
        windows = ("delay_iterations", "max_iterations", "warmup_iterations", "wait_iterations")
        for name, least in (*((n, 0) for n in windows), ("active_iterations", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ProfilerConfig.{name} must be an int >= {least}, got {value!r}.")
        if self.capture_torch_profiler:
            raise NotImplementedError(
                "ProfilerConfig.capture_torch_profiler needs CUDA graphs (not on CPU)."
            )
        if self.torch_profiler_dir and "://" not in self.torch_profiler_dir:
            self.torch_profiler_dir = str(Path(self.torch_profiler_dir).expanduser().absolute())

    @classmethod
    def from_any(cls, value: ProfilerConfig | dict[str, Any] | None) -> ProfilerConfig:
        """A ProfilerConfig from one, a dict, or None (VLLM_TORCH_PROFILER_* variables)."""
        if isinstance(value, ProfilerConfig):
            return value
        if value is not None:
            try:
                return cls(**value)
            except TypeError as e:
                raise ValueError(f"Invalid profiler_config: {e}") from e
        return cls(
            torch_profiler_dir=envs.VLLM_TORCH_PROFILER_DIR or "",
            torch_profiler_with_stack=envs.VLLM_TORCH_PROFILER_WITH_STACK,
            torch_profiler_record_shapes=envs.VLLM_TORCH_PROFILER_RECORD_SHAPES,
            torch_profiler_with_memory=envs.VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY,
            torch_profiler_with_flops=envs.VLLM_TORCH_PROFILER_WITH_FLOPS,
            torch_profiler_use_gzip=envs.VLLM_TORCH_PROFILER_USE_GZIP,
        )


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    weight_transfer_config: WeightTransferConfig | None = None
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    enable_sleep_mode: bool = False
    disable_log_stats: bool = False
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    lora_config: LoRAConfig | None = None  # None: LoRA disabled
