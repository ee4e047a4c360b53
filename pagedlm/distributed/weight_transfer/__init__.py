"""Weight transfer from a trainer to the engine's workers (vLLM's `distributed/weight_transfer`).

Backends: "ipc" (shared-memory tensors on one machine) and "gloo" (a torch.distributed gloo
group between the trainer process and every worker, broadcasting named tensors).
"""

from pagedlm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
from pagedlm.distributed.weight_transfer.factory import WeightTransferEngineFactory

__all__ = [
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdateRequest",
]
