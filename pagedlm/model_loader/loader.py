"""Build the model for a ModelConfig and fill its weights (safetensors, or random for `dummy`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagedlm.config import ModelConfig
from pagedlm.layers.quantization import set_quantization
from pagedlm.model_loader.safetensors_loader import iterate_safetensors
from pagedlm.models.registry import ModelRegistry
from pagedlm.models.weight_reload import finalize_weights

logger = logging.getLogger(__name__)


@contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device):
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def iterate_checkpoint(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs: safetensors, or GGUF (packed blocks under
    quantization="gguf", else dequantized)."""
    if model_config.gguf_file is not None:
        from pagedlm.model_loader.gguf_loader import iterate_gguf

        if model_config.load_format in ("safetensors", "pt"):
            raise ValueError(
                f"load_format={model_config.load_format!r} but the model is a GGUF file; pass "
                "load_format='auto' or 'gguf'."
            )

        return iterate_gguf(
            model_config.gguf_file,
            model_config.hf_config,
            model_config.quantization,
            model_config.dtype,
        )
    if model_config.load_format == "gguf":
        raise ValueError(
            f"load_format='gguf' but {model_config.model_path} is not a .gguf file; pass "
            "load_format='auto'."
        )
    return iterate_safetensors(model_config.model_path, model_config.load_format)


def get_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    start = time.perf_counter()
    model_cls, _, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config.runner, model_config.convert
    )
    kwargs = {"model_dir": model_config.model_path} if model_config.runner_type == "pooling" else {}
    with (
        set_quantization(model_config.quantization),
        _default_dtype_and_device(model_config.dtype, device),
    ):
        model = model_cls(model_config.hf_config, max_position=model_config.max_model_len, **kwargs)
    if model_config.load_format == "dummy":
        generator = torch.Generator().manual_seed(model_config.seed or 0)
        for param in model.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    else:
        model.load_weights(iterate_checkpoint(model_config))
    finalize_weights(model)  # prepacks; from now on load_weights is incremental
    model.eval()
    logger.info(
        "Loaded %s (%s, quantization %s) in %.1fs",
        model_config.architecture,
        model_config.dtype,
        model_config.quantization,
        time.perf_counter() - start,
    )
    return model
