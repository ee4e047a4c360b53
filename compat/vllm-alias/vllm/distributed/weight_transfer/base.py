"""vllm.distributed.weight_transfer.base -> pagedlm.distributed.weight_transfer.base."""

from pagedlm.distributed.weight_transfer.base import (  # noqa: F401
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
