"""vllm.v1.attention.backends.registry (vLLM's newer path of the same enum)."""

from vllm.attention.backends.registry import AttentionBackendEnum  # noqa: F401
