"""vllm.distributed.weight_transfer.ipc_engine -> pagedlm's IPC (shared-memory) engine."""

from pagedlm.distributed.weight_transfer.ipc_engine import (  # noqa: F401
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)
