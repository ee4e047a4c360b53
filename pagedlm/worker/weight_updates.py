"""A worker's weight calls (reached by `collective_rpc` by name): incremental loads, reloads
from the checkpoint, and the RL weight-transfer protocol.

Invariant: a weight update is applied all-or-nothing per `update_weights` call and only
between `start_weight_update` and `finish_weight_update`. Every committed change is reported
to the engine (models/weight_reload.py), which then invalidates its prefix cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedlm.models.weight_reload import weights_missing
from pagedlm.worker.worker_sleep import release_memory_to_os

if TYPE_CHECKING:
    from pagedlm.config import VllmConfig
    from pagedlm.models.interfaces import ModelBase
    from pagedlm.worker.model_runner import ModelRunner


class WorkerWeightUpdatesMixin:
    vllm_config: VllmConfig
    rank: int
    model_runner: ModelRunner | None
    _model: ModelBase  # Worker's: the loaded model
    weight_transfer_engine: Any
    _weight_update_active: bool

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Incremental, non-strict load of checkpoint-named tensors; returns how many params."""
        return len(self._model.load_weights(weights))

    def reload_weights(self) -> None:
        """Load every weight again from the model's checkpoint (e.g. after sleep level 2)."""
        from pagedlm.model_loader.loader import iterate_checkpoint

        self._model.load_weights(iterate_checkpoint(self.vllm_config.model_config))
        release_memory_to_os()  # the checkpoint's staging copies

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from pagedlm.distributed.weight_transfer import WeightTransferEngineFactory

        config = self.vllm_config.weight_transfer_config
        if config is None:
            raise ValueError(
                "Weight transfer is not configured: pass weight_transfer_config="
                "WeightTransferConfig(backend='ipc' or 'gloo') (or a dict) to LLM(...)."
            )
        engine = WeightTransferEngineFactory.create_engine(config, self.vllm_config, self.rank)
        engine.init_transfer_engine(engine.parse_init_info(dict(init_info or {})))
        self._shutdown_transfer_engine()
        self.weight_transfer_engine = engine
        self._weight_update_active = False

    def _transfer_engine(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError(
                "No weight transfer engine: call init_weight_transfer_engine() first."
            )
        return engine

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._transfer_engine()
        if not is_checkpoint_format:
            raise NotImplementedError(
                "start_weight_update(is_checkpoint_format=False) (weights in the engine's "
                "fused layout) is not supported; send Hugging Face checkpoint names."
            )
        if self._weight_update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active; call "
                "finish_weight_update first."
            )
        self._weight_update_active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        engine = self._transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError(
                "update_weights called outside a weight update: call start_weight_update() "
                "first and finish_weight_update() after the last chunk."
            )
        info = engine.parse_update_info(dict(update_info))
        engine.receive_weights(info, self._model.load_weights)

    def finish_weight_update(self) -> None:
        self._transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update."
            )
        self._weight_update_active = False

    def _shutdown_transfer_engine(self) -> None:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.shutdown()
        self.weight_transfer_engine = None
        self._weight_update_active = False

    def shutdown_weight_transfer_engine(self) -> None:
        self._shutdown_transfer_engine()

    def check_weights_present(self) -> None:
        missing = weights_missing(self._model)
        if missing:
            raise RuntimeError(
                f"The weights were discarded by sleep(level=2) and {len(missing)} are not "
                f"loaded yet (e.g. {missing[0]}): push them (update_weights / load_weights) "
                "or call llm.collective_rpc('reload_weights') before generating."
            )
