"""LLM's sleep / wake-up and profiler calls: thin forwards to the engine's parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine


class SleepAndProfilingMixin:
    llm_engine: LLMEngine

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Level 0 pauses scheduling (requests may still be enqueued); level 1 also frees
        the KV cache (weights stay in host memory, where a CPU engine keeps them); level 2
        also frees the weights (push or reload them after `wake_up`). `mode` decides what
        happens to unfinished requests: "abort" them, "wait" for them (their outputs come
        back from the next `wait_for_completion()`), or "keep" them (recomputed after
        waking if their KV was freed)."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the given parts ("weights", "kv_cache", "scheduling"; None: all); True once
        the engine is fully awake."""
        return self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def release_kv_cache_memory(self) -> None:
        """After sleep(level=0): free the KV cache too; `wake_up(tags=["kv_cache"])` restores
        it (kept requests are recomputed)."""
        self.llm_engine.release_kv_cache_memory()

    def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start the torch profiler on every worker (needs profiler_config or
        VLLM_TORCH_PROFILER_DIR); `profile_prefix` starts the trace file names. The iteration
        windows default to profiler_config's delay_iterations / max_iterations."""
        self.llm_engine.start_profile(
            profile_prefix, delay_iterations=delay_iterations, max_iterations=max_iterations
        )

    def stop_profile(self) -> None:
        """Stop and write one Chrome trace per worker rank to the configured directory."""
        self.llm_engine.stop_profile()
