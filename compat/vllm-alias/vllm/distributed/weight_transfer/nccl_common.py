"""vllm.distributed.weight_transfer.nccl_common: not available in pagedlm (see _nccl)."""

from vllm.distributed.weight_transfer._nccl import unavailable as trainer_init  # noqa: F401
