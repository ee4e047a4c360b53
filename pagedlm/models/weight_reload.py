"""Weights after loading: finalize once, then update incrementally, discard and restore.

Invariants:
- `finalize_weights` records every parameter's loader and dense shape/dtype *before*
  `process_weights_after_loading` replaces some with compute layouts (oneDNN prepacked, the
  small-batch kernel's blocked copy; they carry no loader), then marks the model
  `weights_finalized`.
- An incremental update validates every tensor (name, dtype, whole checkpoint shape), stages
  each touched parameter as a dense copy (zeros when the call replaces all of it, else its
  current values recovered exactly from whatever layout holds them), loads the tensors into
  the copies, and only then commits; any error leaves the serving weights untouched. Commit
  copies in place where the parameter is still dense (tied weights stay tied) and replaces it
  where a compute layout took its place; every module whose `process_weights_after_loading`
  reads a touched parameter runs it again, so derived copies are never stale. Quantized
  layers (GGUF packed, int8) refuse updates. Each committed update calls
  `model.weights_changed_callback` (the worker's: the engine invalidates its prefix cache).
- `discard_weights` (sleep level 2) frees every parameter's storage; until each one has been
  loaded again `weights_missing(model)` names what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedlm.models.interfaces import ModelBase

_DERIVED_ATTRS = ("packed_weight", "logits_weight")  # prepacked copies of a module's weight


def _loader(model: nn.Module, name: str, param: nn.Parameter) -> Any:
    """A linear layer's own tensor-parallel loader (its quant method may wrap the param's);
    any other parameter's `weight_loader`."""
    from pagedlm.layers.linear import LinearBase

    module, _ = _owner(model, name)
    if isinstance(module, LinearBase):
        return module.weight_loader
    return getattr(param, "weight_loader", None)


def quantized_method(module: nn.Module) -> str | None:
    """The name of a layer's quantized linear method, None when its weight is dense."""
    from pagedlm.layers.quantization.base import UnquantizedLinearMethod

    method = getattr(module, "quant_method", None)
    if method is None or isinstance(method, UnquantizedLinearMethod):
        return None
    return type(method).__name__


def finalize_weights(model: ModelBase) -> None:
    """Record loaders and dense specs, then build the derived (prepacked) copies."""
    params = model.named_parameters(remove_duplicate=False)
    model._pagedlm_weight_specs = {  # type: ignore[assignment]
        name: (_loader(model, name, p), tuple(p.shape), p.dtype) for name, p in params
    }
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    model.weights_finalized = True  # type: ignore[assignment]
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


def dense_weight(param: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A dense [out, in] copy of a weight, also from a prepacked (oneDNN) layout, whose
    `to_dense()` is the blocked layout for bf16: y = I W^T through the packed weight is exact
    (one nonzero product per output, accumulated in fp32)."""
    from pagedlm.layers.linear import linear

    if not param.is_mkldnn:
        return param.data.clone()
    out_features, in_features = shape
    rows = []
    for start in range(0, in_features, 1024):
        n = min(1024, in_features - start)
        eye = torch.zeros(n, in_features, dtype=param.dtype)
        eye[:, start : start + n] = torch.eye(n, dtype=param.dtype)
        rows.append(linear(eye, param.data))
    return torch.cat(rows).t().contiguous()


def _validate(
    model: nn.Module,
    specs: dict,
    params: dict[str, nn.Parameter],
    mapping: list[tuple[str, str, object]],
    name: str,
    tensor: Any,
) -> tuple[str, object]:
    """The (parameter, shard id) a checkpoint tensor loads into; ValueError if it cannot."""
    from pagedlm.models.weight_utils import resolve_weight_name

    # quantized layers hold no dense parameter (int8 drops it while loading): their names
    # still resolve, so that the refusal below names the method
    quantized = {
        f"{path}.weight" for path, m in model.named_modules() if quantized_method(m) is not None
    }
    resolved = resolve_weight_name(name, specs.keys() | quantized, mapping)
    if resolved is None:
        raise ValueError(
            f"weight {name!r} matches no parameter of the model (nothing was loaded); names "
            "are the Hugging Face checkpoint's, e.g. 'model.layers.0.self_attn.q_proj.weight'."
        )
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(
            f"weight {name!r} must be a floating-point tensor, got "
            f"{getattr(tensor, 'dtype', type(tensor))} (nothing was loaded)."
        )
    target, shard_id = resolved
    method = quantized_method(_owner(model, target)[0])
    if method is not None or target not in params:
        raise ValueError(
            f"weight {name!r} is held quantized in this engine ({method or 'packed'}); weight "
            "updates need dense weights: load the model with quantization=None (for GGUF "
            "files also PAGEDLM_GGUF_DEQUANTIZE=1). Nothing was loaded."
        )
    expected = checkpoint_shape(model, target, shard_id, specs[target][1])
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {expected} "
            "(the whole checkpoint tensor; nothing was loaded)."
        )
    return target, shard_id


def load_weights_incremental(
    model: ModelBase,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Load any subset of checkpoint-named tensors into a finalized model, all or nothing."""
    specs: dict = model._pagedlm_weight_specs  # type: ignore[assignment]
    params = dict(model.named_parameters(remove_duplicate=False))
    items = []  # (name, tensor, target, shard id), all validated before anything is staged
    shards: dict[str, set[object]] = {}
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        target, shard_id = _validate(model, specs, params, stacked_params_mapping, name, tensor)
        items.append((name, tensor, target, shard_id))
        shards.setdefault(target, set()).add(shard_id)
    staged: dict[str, torch.Tensor] = {}
    for name, tensor, target, shard_id in items:
        loader, shape, dtype = specs[target]
        if target not in staged:
            param = params[target]
            whole = shards[target] >= _expected_shards(target, stacked_params_mapping)
            if whole or param.numel() == 0:  # every shard given, or discarded (sleep level 2)
                staged[target] = torch.zeros(shape, dtype=dtype)
            else:  # the shards not given keep their values
                staged[target] = current_dense(_owner(model, target)[0], param, shape)
        try:
            if shard_id is None:
                loader(staged[target], tensor.detach())
            else:
                loader(staged[target], tensor.detach(), shard_id)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"weight {name!r}: {e} (nothing was loaded)") from e
    if staged:
        _note_restored(model, params, shards)  # before commit: ids of the old objects
        _commit(model, params, staged)
        if model.weights_changed_callback is not None:
            model.weights_changed_callback()
    return set(staged)


def _commit(
    model: nn.Module, params: dict[str, nn.Parameter], staged: dict[str, torch.Tensor]
) -> None:
    specs: dict = model._pagedlm_weight_specs  # type: ignore[assignment]
    touched = {id(params[t]) for t in staged}
    owners = set()
    for t in staged:
        module, attr = _owner(model, t)
        owners.add((id(module), attr))
    for target, dense in staged.items():
        param = params[target]
        module, attr = _owner(model, target)
        if param.numel() == 0:  # discarded: same object, so tied aliases see it
            param.data = dense
        elif _is_transformed(param, specs[target][1]):  # a compute layout replaced it
            setattr(module, attr, nn.Parameter(dense, requires_grad=False))
        else:
            param.data.copy_(dense)
    for module in model.modules():
        if not hasattr(module, "process_weights_after_loading"):
            continue
        own = list(module.named_parameters(recurse=False))
        if not any(id(p) in touched or (id(module), n) in owners for n, p in own):
            continue
        prefix = _module_name(model, module)
        for attr, param in own:  # untouched but in a compute layout: processing needs dense
            spec_shape = specs[f"{prefix}{attr}"][1]
            if param.numel() and _is_transformed(param, spec_shape):
                dense = current_dense(module, param, spec_shape)
                setattr(module, attr, nn.Parameter(dense, requires_grad=False))
        for attr in _DERIVED_ATTRS:
            if isinstance(getattr(module, attr, None), torch.Tensor):
                setattr(module, attr, None)
        module.process_weights_after_loading()


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"{name}." if name else ""
    raise KeyError("module not in model")


def _is_transformed(param: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """True when processing replaced the dense weight by a compute layout (oneDNN prepacked,
    or the small-batch kernel's blocked copy)."""
    return param.is_mkldnn or tuple(param.shape) != tuple(shape)


def current_dense(module: nn.Module, param: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The dense [out, in] values of a parameter, whatever layout holds them now."""
    if not _is_transformed(param, shape):
        return param.data.clone()
    if param.is_mkldnn:
        return dense_weight(param, shape)
    for attr in _DERIVED_ATTRS:  # the blocked small-batch copy: read the prepacked one
        packed = getattr(module, attr, None)
        if isinstance(packed, torch.Tensor) and packed.is_mkldnn:
            return dense_weight(packed, shape)
    raise RuntimeError(f"cannot recover the dense values of a {tuple(param.shape)} weight")


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


def check_can_discard(model: nn.Module) -> None:
    """Raise unless every weight could be freed and loaded again (dense layers only)."""
    quantized = {quantized_method(m) for m in model.modules()} - {None}
    if quantized:
        raise NotImplementedError(
            f"sleep(level=2) with quantized weights ({', '.join(sorted(quantized))}) is not "
            "supported: they could not be reloaded into their packed layout; use level 1, or "
            "load the model with quantization=None (GGUF: PAGEDLM_GGUF_DEQUANTIZE=1)."
        )


def discard_weights(model: nn.Module, mapping: list[tuple[str, str, object]]) -> int:
    """Free every parameter's storage and derived copies; returns the bytes released."""
    check_can_discard(model)
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
