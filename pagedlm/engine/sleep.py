"""Sleep and wake-up of an engine: which parts are asleep, and what each level frees.

Invariants:
- asleep (any level, until `wake_up` restores every part; after level >= 1 scheduling comes
  back with the memory, after level 0 only with the "scheduling" tag) the engine refuses to
  step;
- `sleep(level>=1)` leaves no request holding KV blocks (aborted, finished or preempted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.core.scheduler import Scheduler
    from pagedlm.engine.weight_sync import WeightSync
    from pagedlm.executor.abstract import Executor
    from pagedlm.metrics import PrometheusStatLogger

SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
SLEEP_MODES = ("abort", "wait", "keep")


class SleepManager:
    """Holds no reference to the engine (the engine's objects are frozen out of the garbage
    collector: a cycle would outlive `del llm`)."""

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        weight_sync: WeightSync,
        *,
        enable_sleep_mode: bool,
        stat_logger: PrometheusStatLogger | None,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.weight_sync = weight_sync
        self.enable_sleep_mode = enable_sleep_mode
        self.stat_logger = stat_logger
        self.asleep: set[str] = set()  # tags still asleep
        self.sleep_level = 0
        # sleep(level=0) paused scheduling: only wake_up("scheduling") resumes it; after a
        # level >= 1 sleep it resumes once weights and KV cache are resident again
        self._paused_by_level0 = False
        self._stashed_outputs: list[Any] = []
        self._record_state()

    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(
                f"The engine is sleeping (level {self.sleep_level}; asleep: "
                f"{', '.join(sorted(self.asleep))}); call llm.wake_up() before generating."
            )

    def sleep(self, level: int, mode: str, settle: Callable[[str], list[Any]]) -> None:
        """`settle(mode)` aborts the unfinished requests ("abort") or steps until none is left
        ("wait"), returning the outputs of those that finished."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}.")
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep mode must be 'abort', 'wait' or 'keep', got {mode!r}.")
        if level >= 1 and not self.enable_sleep_mode:
            raise ValueError(
                f"sleep(level={level}) frees memory and needs LLM(..., enable_sleep_mode=True);"
                " sleep(level=0) only pauses scheduling."
            )
        if level == 2:  # before touching any request: quantized weights cannot be discarded
            self.executor.collective_rpc("check_can_sleep", args=(level,))
        self._stashed_outputs += settle(mode)
        self.sleep_level = max(self.sleep_level, level) if self.asleep else level
        self.asleep.add("scheduling")
        self._paused_by_level0 = self._paused_by_level0 or level == 0
        if level >= 1:
            self._free_kv_cache(level)
            if level == 2:
                self.asleep.add("weights")
        self._record_state()

    def _free_kv_cache(self, level: int) -> None:
        """Preempt whatever still holds blocks (mode 'keep': recomputed after waking)."""
        self.scheduler.reset_prefix_cache(reset_running_requests=True)
        self.scheduler.kv_cache_manager.invalidate_prefix_cache()
        self.executor.collective_rpc("sleep", args=(level,))
        self.asleep.add("kv_cache")

    def release_kv_cache_memory(self) -> None:
        if "scheduling" not in self.asleep:
            raise RuntimeError(
                "release_kv_cache_memory() needs a paused engine: call sleep(level=0) first."
            )
        if "kv_cache" not in self.asleep:
            self._free_kv_cache(level=1)
            self.sleep_level = max(self.sleep_level, 1)
        self._record_state()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {SLEEP_TAGS}, got {sorted(unknown)}.")
        if "weights" in tags and "weights" in self.asleep:
            self.asleep.discard("weights")
            self.weight_sync.expect_reloaded_weights()  # pushed or reloaded before a step
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.executor.collective_rpc("wake_up_kv_cache")
            self.asleep.discard("kv_cache")
        if "scheduling" in tags:
            self.asleep.discard("scheduling")
            self._paused_by_level0 = False
        if not self._paused_by_level0 and not {"weights", "kv_cache"} & self.asleep:
            self.asleep.discard("scheduling")  # as in vLLM: resident again, so scheduling
        if not self.asleep:
            self.sleep_level = 0
        self._record_state()
        return not self.asleep

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def take_stashed_outputs(self) -> list[Any]:
        """Outputs of requests finished while `sleep(mode='wait')` drained the engine."""
        out, self._stashed_outputs = self._stashed_outputs, []
        return out

    def _record_state(self) -> None:
        if self.stat_logger is None:
            return
        awake = not self.asleep
        self.stat_logger.record_sleep_state(
            awake=awake,
            weights_offloaded=not awake and self.sleep_level == 1,
            discard_all=not awake and self.sleep_level == 2,
        )
