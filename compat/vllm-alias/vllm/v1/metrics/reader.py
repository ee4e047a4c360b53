"""vllm.v1.metrics.reader -> pagedlm.metrics."""

from pagedlm.metrics import Counter, Gauge, Histogram, Metric, Vector  # noqa: F401
