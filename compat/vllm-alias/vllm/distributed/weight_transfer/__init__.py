"""vllm.distributed.weight_transfer -> pagedlm.distributed.weight_transfer (ipc and gloo)."""

from pagedlm.distributed.weight_transfer import (  # noqa: F401
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
