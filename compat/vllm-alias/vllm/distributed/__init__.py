"""vllm.distributed -> pagedlm.distributed (single process: no process groups)."""

from pagedlm.distributed import cleanup_dist_env_and_memory  # noqa: F401
