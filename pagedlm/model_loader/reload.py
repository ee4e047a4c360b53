"""Weights after loading: finalize once, then update incrementally, discard and restore.

Invariants:
- `finalize_weights` records every parameter's `weight_loader` and dense shape/dtype *before*
  `process_weights_after_loading` replaces some with prepacked layouts (which carry no
  loader), then marks the model `weights_finalized`.
- An incremental update stages every touched parameter as a dense copy, loads all given
  tensors into the copies, and only then commits them; any error leaves the serving weights
  untouched. Commit copies in place where the parameter is dense (tied weights stay tied) and
  replaces prepacked ones; every module whose `process_weights_after_loading` reads a touched
  parameter runs it again, so derived copies (oneDNN prepacks, a tied LM head's packed copy)
  are never stale. `model.weights_generation` counts committed updates (the engine resets
  the prefix cache when it moves).
- `discard_weights` (sleep level 2) frees every parameter's storage; until each one has been
  loaded again `weights_missing(model)` names what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

_DERIVED_ATTRS = ("packed_weight", "logits_weight")  # prepacked copies of a module's weight


def finalize_weights(model: nn.Module) -> None:
    """Record loaders and dense specs, then build the derived (prepacked) copies."""
    params = model.named_parameters(remove_duplicate=False)
    model._pagedlm_weight_specs = {  # type: ignore[assignment]
        name: (getattr(p, "weight_loader", None), tuple(p.shape), p.dtype) for name, p in params
    }
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    model.weights_finalized = True  # type: ignore[assignment]
    model.weights_generation = 0  # type: ignore[assignment]
    model._pagedlm_discarded = {}  # type: ignore[assignment]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _expected_shards(target: str, mapping: list[tuple[str, str, object]]) -> set[object]:
    fused = target.rsplit(".", 2)[-2]
    return {sid for p, _, sid in mapping if p.strip(".") == fused} or {None}


def checkpoint_shape(
    model: nn.Module, target: str, shard_id: object, local_shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The whole (unsharded) checkpoint tensor's shape for a parameter, or one fused shard."""
    from pagedlm.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from pagedlm.layers.vocab_embedding import VocabParallelEmbedding

    module, attr = _owner(model, target)
    tail = local_shape[1:]
    if isinstance(module, QKVParallelLinear):
        heads = module.num_heads * module.tp_size
        kv_heads = module.num_kv_heads * module.tp_size // module.num_kv_head_replicas
        rows = (heads if shard_id == "q" else kv_heads) * module.head_size
        return (rows, *tail)
    if isinstance(module, MergedColumnParallelLinear):
        return (module.output_sizes[shard_id] * module.tp_size, *tail)  # type: ignore[index]
    if isinstance(module, ColumnParallelLinear):
        return (local_shape[0] * module.tp_size, *tail)
    if isinstance(module, RowParallelLinear) and attr == "weight":
        return (local_shape[0], local_shape[1] * module.tp_size)
    if isinstance(module, VocabParallelEmbedding) and module.tp_size > 1:
        return (module.num_embeddings, *tail)
    return local_shape


def load_weights_incremental(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Load any subset of checkpoint-named tensors into a finalized model, all or nothing."""
    from pagedlm.models.weight_utils import resolve_weight_name

    specs: dict = model._pagedlm_weight_specs  # type: ignore[assignment]
    params = dict(model.named_parameters(remove_duplicate=False))
    staged: dict[str, torch.Tensor] = {}
    shards: dict[str, set[object]] = {}
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        resolved = resolve_weight_name(name, specs.keys(), stacked_params_mapping)
        if resolved is None:
            raise ValueError(
                f"weight {name!r} matches no parameter of the model (nothing was loaded); "
                "names are the Hugging Face checkpoint's, e.g. 'model.layers.0.self_attn.q_proj"
                ".weight'."
            )
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(
                f"weight {name!r} must be a floating-point tensor, got "
                f"{getattr(tensor, 'dtype', type(tensor))} (nothing was loaded)."
            )
        target, shard_id = resolved
        loader, shape, dtype = specs[target]
        expected = checkpoint_shape(model, target, shard_id, shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{expected} (the whole checkpoint tensor; nothing was loaded)."
            )
        if target not in staged:
            param = params[target]
            if param.numel() == 0:  # discarded (sleep level 2)
                staged[target] = torch.zeros(shape, dtype=dtype)
            elif param.is_mkldnn:
                staged[target] = param.data.to_dense()
            else:
                staged[target] = param.data.clone()
        try:
            if shard_id is None:
                loader(staged[target], tensor.detach())
            else:
                loader(staged[target], tensor.detach(), shard_id)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"weight {name!r}: {e} (nothing was loaded)") from e
        shards.setdefault(target, set()).add(shard_id)
    if staged:
        _note_restored(model, params, shards)  # before commit: ids of the old objects
        _commit(model, params, staged)
        model.weights_generation += 1  # type: ignore[operator]
    return set(staged)


def _commit(
    model: nn.Module, params: dict[str, nn.Parameter], staged: dict[str, torch.Tensor]
) -> None:
    touched = {id(params[t]) for t in staged}
    owners = set()
    for t in staged:
        module, attr = _owner(model, t)
        owners.add((id(module), attr))
    for target, dense in staged.items():
        param = params[target]
        if param.is_mkldnn:  # a prepacked layout replaced it: put the dense weight back
            module, attr = _owner(model, target)
            setattr(module, attr, nn.Parameter(dense, requires_grad=False))
        elif param.numel() == 0:
            param.data = dense
        else:
            param.data.copy_(dense)
    for module in model.modules():
        if not hasattr(module, "process_weights_after_loading"):
            continue
        own = module.named_parameters(recurse=False)
        if any(id(p) in touched or (id(module), n) in owners for n, p in own):
            for attr, param in list(module.named_parameters(recurse=False)):
                if param.is_mkldnn:  # untouched but prepacked: processing starts from dense
                    setattr(module, attr, nn.Parameter(param.data.to_dense(), requires_grad=False))
            module.process_weights_after_loading()


def _note_restored(
    model: nn.Module, params: dict[str, nn.Parameter], shards: dict[str, set[object]]
) -> None:
    """Mark discarded parameters (and their tied aliases) loaded, shard by shard."""
    discarded: dict[str, set[object]] = model._pagedlm_discarded  # type: ignore[assignment]
    if not discarded:
        return
    by_id: dict[int, set[object]] = {}
    for target, loaded in shards.items():
        by_id.setdefault(id(params[target]), set()).update(loaded)
    for name in list(discarded):
        loaded = by_id.get(id(params[name]))
        if loaded:
            discarded[name] -= loaded
            if not discarded[name]:
                del discarded[name]


def discard_weights(model: nn.Module, mapping: list[tuple[str, str, object]]) -> int:
    """Free every parameter's storage and derived copies; returns the bytes released."""
    freed = 0
    seen: set[int] = set()
    for module in model.modules():
        for attr in _DERIVED_ATTRS:
            if isinstance(getattr(module, attr, None), torch.Tensor):
                setattr(module, attr, None)
        for attr, param in list(module.named_parameters(recurse=False)):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if param.numel() == 0:
                continue
            freed += param.numel() * param.element_size()
            empty = torch.empty(0, dtype=param.dtype)
            if param.is_mkldnn:
                setattr(module, attr, nn.Parameter(empty, requires_grad=False))
            else:
                param.data = empty
    specs: dict = model._pagedlm_weight_specs  # type: ignore[assignment]
    model._pagedlm_discarded = {  # type: ignore[assignment]
        name: _expected_shards(name, mapping) for name in specs
    }
    return freed


def weights_missing(model: nn.Module) -> list[str]:
    """Parameters (or shards of fused ones) discarded by sleep level 2 and not loaded since."""
    discarded: dict = getattr(model, "_pagedlm_discarded", {})
    return sorted(
        n if shards == {None} else f"{n} (shards {sorted(map(str, shards))})"
        for n, shards in discarded.items()
    )
