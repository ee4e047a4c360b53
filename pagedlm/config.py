"""Resolved engine configuration: what EngineArgs turns into, read by every component.

Invariants: `max_model_len` never exceeds what the model's positions allow; the scheduler's
token budget is at least `max_model_len` when chunked prefill is off.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    """The longest sequence the model's positions allow (max_position_embeddings and friends)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass
class ModelConfig:
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
    runner_type: str = "generate"  # resolved: "generate" or "pooling"
    runner: str = "auto"  # as requested
    convert: str = "auto"
    pooling_task: str | None = None  # "embed" or "classify" for pooling models

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
        return int(self.hf_config.vocab_size)

    def get_hf_generation_config(self) -> dict[str, Any]:
        """generation_config.json of the model (or of the folder given), {} if none or 'vllm'."""
        if self.generation_config == "vllm":
            return {}
        folder = self.model_path if self.generation_config == "auto" else self.generation_config
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            return {}
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


@dataclass
class ParallelConfig:
    """Process layout; pagedlm runs one engine process (EngineArgs rejects other sizes)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    disable_log_stats: bool = False
    device: str = field(default_factory=lambda: os.environ.get("PAGEDLM_DEVICE", "auto"))
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
