"""pagedlm has no NCCL weight-transfer backend (CPU: use "gloo" or "ipc").

vLLM's NCCL names exist so that modules importing them (TRL's server client) load; using any of
them raises pagedlm's own error for backend "nccl".
"""

from typing import Any

from pagedlm.distributed.weight_transfer import WeightTransferEngineFactory


def unavailable(*args: Any, **kwargs: Any) -> Any:
    WeightTransferEngineFactory.get_engine_class("nccl")  # raises ValueError (NCCL needs CUDA)
    raise AssertionError("pagedlm registered an NCCL weight-transfer backend; use it instead")


class Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unavailable()

    @classmethod
    def trainer_send_weights(cls, *args: Any, **kwargs: Any) -> None:
        unavailable()
