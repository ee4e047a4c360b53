"""RayPrometheusStatLogger: the engine's stats exported through Ray's metrics (ray.util.metrics).

The stat-logger interface is vLLM's: `Logger(vllm_config, engine_index)`, then
`record(scheduler_stats, iteration_stats)` after every engine step and `log()` on
`do_log_stats()`. Ray metric names may not hold ':', so `vllm:x` is exported as `vllm_x`
(vLLM's Ray wrapper does the same). Needs `ray` (the `ray` extra).
"""

from __future__ import annotations

from typing import Any

from pagedlm.metrics import IterationStats, SchedulerStats

_GAUGES = {
    "vllm_num_requests_running": "Requests in the running set.",
    "vllm_num_requests_waiting": "Requests waiting to be scheduled.",
    "vllm_kv_cache_usage_perc": "Fraction of KV cache blocks in use (0-1).",
}
_COUNTERS = {
    "vllm_prompt_tokens": "Prefill tokens processed.",
    "vllm_generation_tokens": "Tokens generated.",
    "vllm_num_preemptions": "Requests preempted.",
    "vllm_prefix_cache_queries": "Prefix-cache lookups, in tokens.",
    "vllm_prefix_cache_hits": "Prefix-cache hits, in tokens.",
    "vllm_request_success": "Requests finished (any reason).",
}


class RayPrometheusStatLogger:
    """Engine stats as ray.util.metrics Gauges and Counters, tagged by model and engine."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        from ray.util.metrics import Counter, Gauge

        keys = ("model_name", "engine")
        self._tags = {
            "model_name": str(vllm_config.model_config.model),
            "engine": str(engine_index),
        }
        self.gauges = {n: Gauge(n, description=d, tag_keys=keys) for n, d in _GAUGES.items()}
        self.counters = {n: Counter(n, description=d, tag_keys=keys) for n, d in _COUNTERS.items()}

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        tags = self._tags
        if scheduler_stats is not None:
            self.gauges["vllm_num_requests_running"].set(scheduler_stats.num_running, tags)
            self.gauges["vllm_num_requests_waiting"].set(scheduler_stats.num_waiting, tags)
            self.gauges["vllm_kv_cache_usage_perc"].set(scheduler_stats.kv_cache_usage, tags)
            self._inc("vllm_num_preemptions", scheduler_stats.num_preemptions)
            self._inc("vllm_prefix_cache_queries", scheduler_stats.prefix_cache_queries)
            self._inc("vllm_prefix_cache_hits", scheduler_stats.prefix_cache_hits)
        if iteration_stats is not None:
            self._inc("vllm_prompt_tokens", iteration_stats.num_prompt_tokens)
            self._inc("vllm_generation_tokens", iteration_stats.num_generation_tokens)
            self._inc("vllm_request_success", len(iteration_stats.finished_requests))

    def _inc(self, name: str, value: float) -> None:
        if value > 0:  # ray's Counter rejects non-positive increments
            self.counters[name].inc(value, self._tags)

    def log_engine_initialized(self) -> None:
        """Nothing to report: the metrics appear on Ray's endpoint as they are recorded."""

    def log(self) -> None:
        """Ray exports continuously; nothing to flush."""
