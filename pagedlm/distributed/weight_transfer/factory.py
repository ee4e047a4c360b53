"""Registry of weight-transfer backends, imported lazily by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from pagedlm.config import VllmConfig, WeightTransferConfig
from pagedlm.distributed.weight_transfer.base import WeightTransferEngine


class WeightTransferEngineFactory:
    _registry: dict[str, Callable[[], type[WeightTransferEngine]]] = {}

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[WeightTransferEngine],
        class_name: str | None = None,
    ) -> None:
        """Register `name` -> an engine class, or a module path and class name (lazy)."""
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine {name!r} is already registered.")
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError("class_name is required when registering with a module path")
            path = module_path_or_cls
            cls._registry[name] = lambda: getattr(importlib.import_module(path), class_name)
        else:
            engine_cls = module_path_or_cls
            cls._registry[name] = lambda: engine_cls

    @classmethod
    def get_engine_class(cls, backend: str) -> type[WeightTransferEngine]:
        if backend not in cls._registry:
            hint = " (NCCL needs CUDA; on CPU use 'gloo')" if backend == "nccl" else ""
            raise ValueError(
                f"Invalid weight transfer backend: {backend!r}{hint}. Available engines: "
                f"{sorted(cls._registry)}"
            )
        return cls._registry[backend]()

    @classmethod
    def create_engine(
        cls, config: WeightTransferConfig, vllm_config: VllmConfig, rank: int
    ) -> WeightTransferEngine:
        return cls.get_engine_class(config.backend)(config, vllm_config, rank)


WeightTransferEngineFactory.register_engine(
    "ipc", "pagedlm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferEngine"
)
WeightTransferEngineFactory.register_engine(
    "gloo", "pagedlm.distributed.weight_transfer.gloo_engine", "GlooWeightTransferEngine"
)
