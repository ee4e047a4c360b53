"""vllm.distributed.weight_transfer.packed_tensor: not available in pagedlm (see _nccl)."""

from vllm.distributed.weight_transfer._nccl import (  # noqa: F401
    unavailable as packed_nccl_broadcast_producer,
)
