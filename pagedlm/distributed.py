"""vLLM's `vllm.distributed` helpers that apply to a single-process CPU engine."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free what deleted engines left behind (pagedlm holds no process groups).

    With `shutdown_ray=True`, also shut a local Ray runtime down (as vLLM does).
    """
    gc.collect()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            return
        ray.shutdown()
