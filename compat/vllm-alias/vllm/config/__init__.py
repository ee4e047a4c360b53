"""vllm.config -> pagedlm.config."""

from pagedlm.config import (  # noqa: F401
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
