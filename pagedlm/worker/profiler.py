"""A worker's torch profiler session, with vLLM's iteration windows.

A session opens at `start()` and closes at `stop()` (or by itself after `max_iterations`
recorded engine steps). Within it: `delay_iterations` steps pass before the profiler starts;
with `wait_iterations` / `warmup_iterations` set, a `torch.profiler.schedule` then waits,
warms up (recorded and discarded) and records `active_iterations` steps; warm-up steps do not
count toward `max_iterations`. `step()` runs after every engine step of the worker.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from pagedlm.config import ProfilerConfig, VllmConfig

logger = logging.getLogger(__name__)


class WorkerProfiler:
    def __init__(self, config: ProfilerConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.active = False  # between start() and stop()
        self._profiler: torch.profiler.profile | None = None  # running
        self._prefix: str | None = None
        self._delay = self._max = self._steps = self._recorded = self._warmup_left = 0
        self._trace: str | None = None  # this session's trace, once written

    def start(
        self,
        prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        for name, value in (
            ("delay_iterations", delay_iterations),
            ("max_iterations", max_iterations),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be greater than or equal to 0, got {value!r}.")
        c = self.config
        self._delay = c.delay_iterations if delay_iterations is None else delay_iterations
        self._max = c.max_iterations if max_iterations is None else max_iterations
        self._prefix, self._steps, self._recorded, self.active = prefix, 0, 0, True
        self._trace = None
        if self._delay == 0:
            self._start_profiler()

    def step(self) -> None:
        """After one engine step: start after the delay, advance the schedule, stop at max."""
        if not self.active:
            return
        self._steps += 1
        if self._profiler is None and self._delay and self._steps == self._delay:
            self._start_profiler()
            return
        if self._profiler is None:
            return
        if self._scheduled:
            self._profiler.step()
            if self._warmup_left:
                self._warmup_left -= 1
                return
        self._recorded += 1
        if self._max and self._recorded >= self._max:
            logger.info("Profiler: %d iterations recorded, stopping.", self._recorded)
            self.stop()

    def stop(self) -> str | None:
        """Close the session; the path of its trace, None if the profiler never ran."""
        if not self.active:  # stopped by max_iterations already: as vLLM, nothing to do
            return self._trace
        self.active = False
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # with a schedule, writes the trace if the active window was open
            if self._trace is None and not self._scheduled:
                self._export(profiler)
        return self._trace

    @property
    def _scheduled(self) -> bool:
        return bool(self.config.wait_iterations or self.config.warmup_iterations)

    def _start_profiler(self) -> None:
        c = self.config
        schedule = None
        if self._scheduled:
            schedule = torch.profiler.schedule(
                wait=c.wait_iterations,
                warmup=c.warmup_iterations,
                active=c.active_iterations,
                repeat=1,
            )
            # start() itself takes the schedule's first step (waiting or warming up)
            self._warmup_left = max(c.wait_iterations + c.warmup_iterations - 1, 0)
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=schedule,
            on_trace_ready=self._export if schedule is not None else None,
            record_shapes=c.torch_profiler_record_shapes,
            with_stack=c.torch_profiler_with_stack,
            profile_memory=c.torch_profiler_with_memory,
            with_flops=c.torch_profiler_with_flops,
        )
        self._profiler.start()

    def _export(self, profiler: torch.profiler.profile) -> None:
        """Write this rank's Chrome trace (once per session) to `torch_profiler_dir`."""
        if self._trace is not None:
            return
        c = self.config
        directory = Path(c.torch_profiler_dir)
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        suffix = ".pt.trace.json.gz" if c.torch_profiler_use_gzip else ".pt.trace.json"
        name = f"{self._prefix or 'pagedlm'}_rank{self.rank}_pid{os.getpid()}_{stamp}{suffix}"
        self._trace = str(directory / name)
        profiler.export_chrome_trace(self._trace)
        logger.info("Profiler trace of rank %d written to %s", self.rank, self._trace)


class ProfilerAlreadyActiveError(RuntimeError):
    """start_profile() while a profile is running."""


class WorkerProfilerMixin:
    """The worker's `start_profile` / `stop_profile` (reached by `collective_rpc` by name)."""

    vllm_config: VllmConfig
    rank: int
    profiler: WorkerProfiler | None

    def start_profile(
        self,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        config = self.vllm_config.profiler_config
        if config.profiler != "torch":
            raise RuntimeError(
                "Profiling is not enabled: pass profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': '/path'} to LLM(...) or set VLLM_TORCH_PROFILER_DIR."
            )
        profiler = self.profiler
        if profiler is None:
            profiler = self.profiler = WorkerProfiler(config, self.rank)
        if profiler.active:
            raise ProfilerAlreadyActiveError(
                "A profile is already running: call stop_profile() first."
            )
        profiler.start(profile_prefix, delay_iterations, max_iterations)

    def stop_profile(self) -> str | None:
        """Stop and write this rank's Chrome trace; its path (None if nothing was recorded)."""
        # as vLLM, stopping a stopped (or never started) profiler does nothing
        return None if self.profiler is None else self.profiler.stop()
