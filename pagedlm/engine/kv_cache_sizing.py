"""How many KV cache blocks the engine allocates, and what to change when one sequence of
`max_model_len` does not fit.

Every rank stores its own heads of every block, so the count is what the tightest rank holds:
`num_gpu_blocks_override`, else `kv_cache_memory_bytes`, else `gpu_memory_utilization` of the
memory left beside the model; never more than `max_num_seqs` full-length sequences use.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from pagedlm.config import VllmConfig
from pagedlm.utils import cdiv

if TYPE_CHECKING:
    from pagedlm.executor.abstract import Executor

logger = logging.getLogger(__name__)


def determine_num_blocks(vllm_config: VllmConfig, executor: Executor) -> int:
    """Blocks every rank can hold (each rank stores its own heads of every block)."""
    cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
    block_size = cache.block_size
    per_block = max(executor.collective_rpc("get_kv_cache_bytes_per_block", args=(block_size,)))
    max_len = vllm_config.model_config.max_model_len
    blocks_per_seq = cdiv(max_len, block_size)
    budget = cache.kv_cache_memory_bytes
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        if budget is None:
            budget = min(
                executor.collective_rpc(
                    "determine_available_memory", args=(cache.gpu_memory_utilization,)
                )
            )
        # More blocks than max_num_seqs full-length sequences would never be used at once.
        num_blocks = min(budget // max(per_block, 1), sched.max_num_seqs * blocks_per_seq + 1)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"The KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks), "
            f"fewer than one sequence of max_model_len={max_len}. "
            + _kv_budget_advice(
                vllm_config, executor, blocks_per_seq, blocks_per_seq * per_block, budget
            )
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB); maximum concurrency for %d tokens per "
        "request: %.2fx",
        num_blocks,
        block_size,
        num_blocks * per_block / 2**30,
        max_len,
        num_blocks / blocks_per_seq,
    )
    return num_blocks


def _kv_budget_advice(
    vllm_config: VllmConfig,
    executor: Executor,
    blocks_needed: int,
    bytes_needed: int,
    budget: int | None,
) -> str:
    """Which option to raise, and to what, for one sequence of max_model_len to fit
    (`budget`: the bytes a rank was given)."""
    cache = vllm_config.cache_config
    gib = f"{bytes_needed / 2**30:.2f} GiB"
    if cache.num_gpu_blocks_override is not None:
        return f"Raise num_gpu_blocks_override to at least {blocks_needed}."
    if cache.kv_cache_memory_bytes is not None:
        return f"Raise kv_cache_memory_bytes to at least {bytes_needed} ({gib})."
    world = vllm_config.parallel_config.world_size
    total = executor.collective_rpc("total_memory_bytes")[0]
    utilization = cache.gpu_memory_utilization
    raised = utilization + (bytes_needed - (budget or 0)) * world / total
    raised = min(math.ceil(raised * 100) / 100, 1.0)
    return (
        f"It needs {gib} per rank: pass kv_cache_memory_bytes={bytes_needed}, raise "
        f"gpu_memory_utilization from {utilization} to at least {raised} (if that much "
        "memory is free), or lower max_model_len."
    )
