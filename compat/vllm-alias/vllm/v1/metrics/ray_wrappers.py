"""vllm.v1.metrics.ray_wrappers -> pagedlm.metrics_ray (needs ray)."""

from pagedlm.metrics_ray import RayPrometheusStatLogger  # noqa: F401
