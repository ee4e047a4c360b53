"""Process groups and collectives for tensor parallelism (gloo on CPU, NCCL on CUDA)."""

from pagedlm.distributed.parallel_state import (
    cleanup_dist_env_and_memory,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)

__all__ = [
    "cleanup_dist_env_and_memory",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
]
