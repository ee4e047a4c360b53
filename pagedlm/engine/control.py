"""LLMEngine control: weight versions and prefix-cache invalidation, sleep / wake-up,
profiling. Mixed into LLMEngine.

Invariants:
- before each step the engine compares the workers' weight generation with the one it last
  saw; when weights changed (by any path: weight transfer, `load_weights` on the model,
  `collective_rpc`) the prefix cache is invalidated before scheduling, so no request reuses
  KV computed with other weights. Running requests keep their KV and go on.
- asleep (any level, until `wake_up` restores every part; after level >= 1 scheduling comes
  back with the memory, after level 0 only with the "scheduling" tag) the engine refuses to
  step;
  `sleep(level>=1)` leaves no request holding KV blocks (aborted, finished or preempted).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache", "scheduling")


class EngineControlMixin:
    """Expects `model_executor`, `scheduler`, `output_processor`, `vllm_config`."""

    model_executor: Any
    scheduler: Any
    output_processor: Any
    vllm_config: Any
    stat_logger: Any

    def _init_control(self) -> None:
        self.weight_version: str | None = None
        self._weights_generation = 0
        self._control_rpc_since_check = False
        self.asleep: set[str] = set()  # tags still asleep
        self.sleep_level = 0
        # sleep(level=0) paused scheduling: only wake_up("scheduling") resumes it; after a
        # level >= 1 sleep it resumes once weights and KV cache are resident again
        self._paused_by_level0 = False
        self._weights_need_check = False
        self._stashed_outputs: list[Any] = []
        self._record_sleep_state()

    # ------------------------------------------------------------ weights
    def _note_control_rpc(self) -> None:
        self._control_rpc_since_check = True

    def sync_weights_generation(self) -> None:
        """Invalidate the prefix cache if the workers' weights changed since the last step."""
        executor = self.model_executor
        if not (executor.in_process or self._control_rpc_since_check):
            return
        self._control_rpc_since_check = False
        generation = executor.get_weights_generation()
        if generation != self._weights_generation:
            self._weights_generation = generation
            self.scheduler.kv_cache_manager.invalidate_prefix_cache()
            logger.info("Weights changed: prefix cache invalidated")
        self.check_weights_present()

    def check_weights_present(self) -> None:
        """After sleep(level=2): raise until every discarded weight was loaded again."""
        if self._weights_need_check:
            self.model_executor.collective_rpc("check_weights_present")
            self._weights_need_check = False

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def get_weight_version(self) -> str | None:
        return self.weight_version

    # -------------------------------------------------------------- sleep
    def check_can_generate(self) -> None:
        """Raise (before any request is added) if a step could not run now."""
        self.check_awake()
        self.check_weights_present()

    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(
                f"The engine is sleeping (level {self.sleep_level}; asleep: "
                f"{', '.join(sorted(self.asleep))}); call llm.wake_up() before generating."
            )

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}.")
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"sleep mode must be 'abort', 'wait' or 'keep', got {mode!r}.")
        if level >= 1 and not self.vllm_config.enable_sleep_mode:
            raise ValueError(
                f"sleep(level={level}) frees memory and needs LLM(..., enable_sleep_mode=True);"
                " sleep(level=0) only pauses scheduling."
            )
        if level == 2:  # before touching any request: quantized weights cannot be discarded
            self.model_executor.collective_rpc("check_can_sleep", args=(level,))
        self._settle_requests(mode)
        self.sleep_level = max(self.sleep_level, level) if self.asleep else level
        self.asleep.add("scheduling")
        self._paused_by_level0 = self._paused_by_level0 or level == 0
        if level >= 1:
            self._free_kv_cache(level)
            if level == 2:
                self.asleep.add("weights")
        self._record_sleep_state()

    def _settle_requests(self, mode: str) -> None:
        if mode == "abort":
            self.abort_all_requests()  # type: ignore[attr-defined]
        elif mode == "wait":
            while self.has_unfinished_requests():  # type: ignore[attr-defined]
                self._stashed_outputs += [o for o in self.step() if o.finished]  # type: ignore[attr-defined]

    def _free_kv_cache(self, level: int) -> None:
        """Preempt whatever still holds blocks (mode 'keep': recomputed after waking)."""
        self.scheduler.reset_prefix_cache(reset_running_requests=True)
        self.scheduler.kv_cache_manager.invalidate_prefix_cache()
        self.model_executor.collective_rpc("sleep", args=(level,))
        self.asleep.add("kv_cache")

    def release_kv_cache_memory(self) -> None:
        if "scheduling" not in self.asleep:
            raise RuntimeError(
                "release_kv_cache_memory() needs a paused engine: call sleep(level=0) first."
            )
        if "kv_cache" not in self.asleep:
            self._free_kv_cache(level=1)
            self.sleep_level = max(self.sleep_level, 1)
        self._record_sleep_state()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {SLEEP_TAGS}, got {sorted(unknown)}.")
        if "weights" in tags and "weights" in self.asleep:
            self.asleep.discard("weights")
            self._weights_need_check = True  # pushed or reloaded before the next step
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.model_executor.collective_rpc("wake_up_kv_cache")
            self.asleep.discard("kv_cache")
        if "scheduling" in tags:
            self.asleep.discard("scheduling")
            self._paused_by_level0 = False
        if not self._paused_by_level0 and not {"weights", "kv_cache"} & self.asleep:
            self.asleep.discard("scheduling")  # as in vLLM: resident again, so scheduling
        if not self.asleep:
            self.sleep_level = 0
        self._record_sleep_state()
        return not self.asleep

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def take_stashed_outputs(self) -> list[Any]:
        """Outputs of requests finished while `sleep(mode='wait')` drained the engine."""
        out, self._stashed_outputs = self._stashed_outputs, []
        return out

    def _record_sleep_state(self) -> None:
        if self.stat_logger is None:
            return
        awake = not self.asleep
        self.stat_logger.record_sleep_state(
            awake=awake,
            weights_offloaded=not awake and self.sleep_level == 1,
            discard_all=not awake and self.sleep_level == 2,
        )

    # ------------------------------------------------------------ profiler
    def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        self.model_executor.collective_rpc(
            "start_profile", args=(profile_prefix, delay_iterations, max_iterations)
        )

    def stop_profile(self) -> list[str]:
        return self.model_executor.collective_rpc("stop_profile")
