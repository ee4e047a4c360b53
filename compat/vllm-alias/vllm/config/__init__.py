"""vllm.config -> pagedlm.config; config classes pagedlm lacks import, and refuse to be built."""

from typing import Literal

from pagedlm.config import (  # noqa: F401
    CacheConfig,
    LoRAConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    WeightTransferConfig,
)
from vllm._unsupported import missing_attribute, unsupported_class
from vllm.config.model import ConvertOption, ModelConfig, RunnerOption  # noqa: F401

# load_format values pagedlm reads (LLM(load_format=...)); vLLM's others are refused
LoadFormat = Literal["auto", "safetensors", "gguf", "pt", "dummy"]

_WHY = (
    "pagedlm has no such option group; pass its fields to LLM(...) (the README lists what is "
    "not implemented)."
)
AttentionConfig = unsupported_class("vllm.config.AttentionConfig", _WHY)
CompilationConfig = unsupported_class("vllm.config.CompilationConfig", _WHY)
DeviceConfig = unsupported_class("vllm.config.DeviceConfig", _WHY)
LoadConfig = unsupported_class("vllm.config.LoadConfig", _WHY)
MultiModalConfig = unsupported_class("vllm.config.MultiModalConfig", _WHY)
ObservabilityConfig = unsupported_class("vllm.config.ObservabilityConfig", _WHY)
PoolerConfig = unsupported_class("vllm.config.PoolerConfig", _WHY)
KVTransferConfig = unsupported_class("vllm.config.KVTransferConfig", _WHY)


def __getattr__(name: str):
    raise missing_attribute("vllm.config", name)
