"""Copy checkpoint tensors into model parameters through each parameter's `weight_loader`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Load (name, tensor) pairs; fused parameters get their shard id. Returns loaded names.

    Raises ValueError for a checkpoint tensor with no parameter to receive it, and for
    parameters the checkpoint did not provide.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    shards_loaded: dict[str, set[object]] = {}
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        for param_name, shard_name, shard_id in stacked_params_mapping:
            if shard_name in name:
                target = name.replace(shard_name, param_name)
                if target in params:
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)
                    loaded.add(target)
                    shards_loaded.setdefault(target, set()).add(shard_id)
                    break
        else:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            param = params[name]
            param.weight_loader(param, tensor)
            loaded.add(name)
    missing = {
        n for n, p in model.named_parameters() if n not in loaded and not n.endswith(skip_suffixes)
    }
    for target, shards in shards_loaded.items():  # a fused parameter needs every shard
        fused = target.rsplit(".", 2)[-2]
        expected = {sid for p, _, sid in stacked_params_mapping if p.strip(".") == fused}
        missing |= {f"{target} (shard {sid})" for sid in expected - shards}
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for: {', '.join(sorted(missing)[:8])}"
            + (" ..." if len(missing) > 8 else "")
            + ". The files may be truncated or for another architecture."
        )
    return loaded
