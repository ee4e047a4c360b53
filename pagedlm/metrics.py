"""Prometheus metrics named as vLLM names them, and the `get_metrics()` snapshot reader.

Metric objects live in prometheus_client's global registry, created once per process and
labelled by `model_name` and `engine` (an index per LLMEngine), so existing vLLM dashboards
work unchanged. Counters are reported without the `_total` suffix, as vLLM's reader does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import REGISTRY

_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
_LABELS = ["model_name", "engine"]
_engine_ids = itertools.count()
_metrics: dict[str, Any] = {}


def _make_metrics() -> dict[str, Any]:
    if _metrics:
        return _metrics
    g, c, h = prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram
    specs = [
        (g, "vllm:num_requests_running", "Requests in model execution batches.", None),
        (g, "vllm:num_requests_waiting", "Requests waiting to be processed.", None),
        (g, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", None),
        (c, "vllm:prompt_tokens", "Number of prefill tokens processed.", None),
        (c, "vllm:generation_tokens", "Number of generation tokens processed.", None),
        (c, "vllm:num_preemptions", "Cumulative number of preemptions.", None),
        (c, "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", None),
        (c, "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", None),
        (c, "vllm:mm_cache_queries", "Multi-modal cache queries, in items.", None),
        (c, "vllm:mm_cache_hits", "Multi-modal cache hits, in items.", None),
        (h, "vllm:time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS),
        (h, "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", _ITL_BUCKETS),
        (
            h,
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            _LATENCY_BUCKETS,
        ),
        (h, "vllm:request_queue_time_seconds", "Time spent in WAITING phase.", _LATENCY_BUCKETS),
        (h, "vllm:request_prefill_time_seconds", "Time spent in PREFILL phase.", _LATENCY_BUCKETS),
        (h, "vllm:request_decode_time_seconds", "Time spent in DECODE phase.", _LATENCY_BUCKETS),
        (
            h,
            "vllm:request_inference_time_seconds",
            "Time spent in RUNNING phase.",
            _LATENCY_BUCKETS,
        ),
        (h, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_BUCKETS),
        (
            h,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            _TOKEN_BUCKETS,
        ),
        (h, "vllm:request_params_n", "The n request parameter.", [1, 2, 5, 10, 20]),
        (h, "vllm:request_params_max_tokens", "The max_tokens request parameter.", _TOKEN_BUCKETS),
    ]
    for cls, name, doc, buckets in specs:
        kwargs = {"buckets": buckets} if buckets else {}
        _metrics[name] = cls(name, doc, _LABELS, **kwargs)
    _metrics["vllm:request_success"] = c(
        "vllm:request_success",
        "Count of successfully processed requests.",
        _LABELS + ["finished_reason"],
    )
    for name, doc in _SPEC_COUNTERS.items():
        _metrics[name] = c(name, doc, _LABELS)
    _metrics[_SPEC_PER_POS] = c(
        _SPEC_PER_POS, "Accepted tokens, per draft token position.", _LABELS + ["position"]
    )
    _metrics["vllm:engine_sleep_state"] = g(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        _LABELS + ["sleep_state"],
    )
    return _metrics


def _lora_info_gauge() -> Any:
    """Created on first use (LoRA engines only), like vLLM's."""
    if _LORA_INFO not in _metrics:
        _metrics[_LORA_INFO] = prometheus_client.Gauge(
            _LORA_INFO,
            "Running stats on lora requests.",
            _LABELS + ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
    return _metrics[_LORA_INFO]


_LORA_INFO = "vllm:lora_requests_info"
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}
_SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_LABELED = ("vllm:request_success", _SPEC_PER_POS, "vllm:engine_sleep_state", _LORA_INFO)


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None
    n: int
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: Any = None
    mm_cache_queries: int = 0  # processed-image cache lookups since the last record, items
    mm_cache_hits: int = 0  # core.scheduler.SpecDecodingStats, when speculative decoding


class PrometheusStatLogger:
    """Records one engine's stats into the shared vLLM-named Prometheus metrics."""

    def __init__(self, model_name: str) -> None:
        metrics = _make_metrics()
        labels = {"model_name": model_name, "engine": str(next(_engine_ids))}
        self._labels = labels
        self.m = {
            name: metric.labels(**labels)
            for name, metric in metrics.items()
            if name not in _LABELED
        }
        self._success = metrics["vllm:request_success"]
        self._per_pos = metrics[_SPEC_PER_POS]
        self._sleep_state = metrics["vllm:engine_sleep_state"]
        self._lora_labels: tuple[str, ...] | None = None

    def record_sleep_state(self, awake: bool, weights_offloaded: bool, discard_all: bool) -> None:
        states = {"awake": awake, "weights_offloaded": weights_offloaded}
        states["discard_all"] = discard_all
        for state, value in states.items():
            self._sleep_state.labels(**self._labels, sleep_state=state).set(int(value))

    def record_lora_info(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """vllm:lora_requests_info: the adapters of running and waiting requests (labels,
        comma-separated), set to the current time; the engine's previous label set goes."""
        gauge = _lora_info_gauge()
        labels = (*self._labels.values(), str(max_lora), ",".join(waiting), ",".join(running))
        if self._lora_labels is not None and self._lora_labels != labels:
            gauge.remove(*self._lora_labels)
        self._lora_labels = labels
        gauge.labels(*labels).set_to_current_time()

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        m = self.m
        m["vllm:num_requests_running"].set(sched.num_running)
        m["vllm:num_requests_waiting"].set(sched.num_waiting)
        m["vllm:kv_cache_usage_perc"].set(sched.kv_cache_usage)
        m["vllm:prefix_cache_queries"].inc(sched.prefix_cache_queries)
        m["vllm:prefix_cache_hits"].inc(sched.prefix_cache_hits)
        m["vllm:mm_cache_queries"].inc(sched.mm_cache_queries)
        m["vllm:mm_cache_hits"].inc(sched.mm_cache_hits)
        m["vllm:num_preemptions"].inc(sched.num_preemptions)
        spec = sched.spec_decoding
        if spec is not None:
            m["vllm:spec_decode_num_drafts"].inc(spec.num_drafts)
            m["vllm:spec_decode_num_draft_tokens"].inc(spec.num_draft_tokens)
            m["vllm:spec_decode_num_accepted_tokens"].inc(spec.num_accepted_tokens)
            for pos, accepted in enumerate(spec.num_accepted_tokens_per_pos):
                self._per_pos.labels(**self._labels, position=str(pos)).inc(accepted)
        m["vllm:prompt_tokens"].inc(it.num_prompt_tokens)
        m["vllm:generation_tokens"].inc(it.num_generation_tokens)
        for ttft in it.time_to_first_tokens:
            m["vllm:time_to_first_token_seconds"].observe(ttft)
        for itl in it.inter_token_latencies:
            m["vllm:inter_token_latency_seconds"].observe(itl)
        for f in it.finished_requests:
            self._success.labels(**self._labels, finished_reason=f.finish_reason).inc()
            m["vllm:e2e_request_latency_seconds"].observe(f.e2e_latency)
            m["vllm:request_queue_time_seconds"].observe(f.queued_time)
            m["vllm:request_prefill_time_seconds"].observe(f.prefill_time)
            m["vllm:request_decode_time_seconds"].observe(f.decode_time)
            m["vllm:request_inference_time_seconds"].observe(f.inference_time)
            m["vllm:request_prompt_tokens"].observe(f.num_prompt_tokens)
            m["vllm:request_generation_tokens"].observe(f.num_generation_tokens)
            m["vllm:request_params_n"].observe(f.n)
            if f.max_tokens is not None:
                m["vllm:request_params_max_tokens"].observe(f.max_tokens)


# ------------------------------------------------------------------------- reader
@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class Vector(Metric):
    values: list[int]


def get_metrics_snapshot(registry: Any = REGISTRY) -> list[Metric]:
    """Every `vllm:` metric in the registry, one object per label set."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            out += [Gauge(s.name, s.labels, s.value) for s in family.samples]
        elif family.name == _SPEC_PER_POS:
            out += _vectors(family)
        elif family.type == "counter":
            out += [
                Counter(family.name, s.labels, int(s.value))
                for s in family.samples
                if s.name.endswith("_total")
            ]
        elif family.type == "histogram":
            out += _histograms(family)
    return out


def _vectors(family: Any) -> list[Vector]:
    """A counter labelled by `position` becomes one Vector per engine, values by position."""
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in family.samples:
        if not s.name.endswith("_total"):
            continue
        labels = {k: v for k, v in s.labels.items() if k != "position"}
        key = tuple(sorted(labels.items()))
        by_labels.setdefault(key, {})[int(s.labels["position"])] = int(s.value)
    return [
        Vector(family.name, dict(key), [values[p] for p in sorted(values)])
        for key, values in by_labels.items()
    ]


def _histograms(family: Any) -> list[Histogram]:
    by_labels: dict[tuple, Histogram] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        hist = by_labels.setdefault(key, Histogram(family.name, labels, 0, 0.0, {}))
        if s.name.endswith("_bucket"):
            hist.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            hist.count = int(s.value)
        elif s.name.endswith("_sum"):
            hist.sum = s.value
    return list(by_labels.values())
