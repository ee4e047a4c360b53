"""Copy checkpoint tensors into model parameters through each parameter's `weight_loader`.

Two regimes, chosen by the model's state:
- before `finalize_weights` (checkpoint loading): strict, every parameter must be provided;
- after it (RL updates, `model.load_weights([(name, tensor)])`): incremental and non-strict,
  any subset in any number of calls, all-or-nothing per call (see models/weight_reload.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def resolve_weight_name(
    name: str,
    params: dict[str, nn.Parameter] | set[str],
    stacked_params_mapping: list[tuple[str, str, object]],
) -> tuple[str, object] | None:
    """Checkpoint name -> (parameter name, shard id or None); None if nothing receives it."""
    for param_name, shard_name, shard_id in stacked_params_mapping:
        if shard_name in name:
            target = name.replace(shard_name, param_name)
            if target in params:
                return target, shard_id
    if name in params:
        return name, None
    return None


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Load (name, tensor) pairs; fused parameters get their shard id. Returns loaded names.

    Checkpoint loading raises ValueError for a checkpoint tensor with no parameter to receive
    it, and for parameters the checkpoint did not provide. Once the model's weights are
    finalized, loading is incremental (only the names given change).
    """
    if model.weights_finalized:
        from pagedlm.models.weight_reload import load_weights_incremental

        return load_weights_incremental(model, weights, stacked_params_mapping, skip_suffixes)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    shards_loaded: dict[str, set[object]] = {}
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        resolved = resolve_weight_name(name, params, stacked_params_mapping)
        if resolved is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
        target, shard_id = resolved
        param = params[target]
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)
            shards_loaded.setdefault(target, set()).add(shard_id)
        loaded.add(target)
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
