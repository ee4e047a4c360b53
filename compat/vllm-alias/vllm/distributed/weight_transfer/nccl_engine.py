"""vllm.distributed.weight_transfer.nccl_engine: not available in pagedlm (see _nccl)."""

from vllm.distributed.weight_transfer._nccl import Unavailable


class NCCLWeightTransferEngine(Unavailable):
    """Raises pagedlm's error for backend "nccl" when used."""


class NCCLTrainerSendWeightsArgs(Unavailable):
    """Raises pagedlm's error for backend "nccl" when used."""
