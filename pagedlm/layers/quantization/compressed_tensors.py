"""Which `compressed-tensors` checkpoints load: int8 W8A8 as llm-compressor writes it for
vLLM (`quantization_config.quant_method == "compressed-tensors"`, format `int-quantized`),
symmetric int8 weights per output channel, int8 input activations quantized dynamically
(vLLM: per token; here per 32 or 128 values, or per token where the layer allows it on
AMX, see `int8.py`). Anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

QUANT_METHOD = "compressed-tensors"
SUPPORTED = (
    "int8 W8A8 (format 'int-quantized': weights num_bits 8, symmetric, strategy 'channel'; "
    "input_activations num_bits 8, dynamic, strategy 'token'), ignore ['lm_head']"
)


def _quantization_config(hf_config: Any) -> dict | None:
    """The checkpoint config's `quantization_config` as a dict (transformers may hold an
    object), or None."""
    qc = getattr(hf_config, "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """`quantization_config.quant_method` of a checkpoint's config, if it has one."""
    qc = _quantization_config(hf_config)
    return None if qc is None else qc.get("quant_method")


def check_config(hf_config: Any) -> None:
    """Raise NotImplementedError naming the first part of the checkpoint's
    quantization_config that pagedlm cannot run; return if it is int8 W8A8."""
    qc = _quantization_config(hf_config)

    def refuse(what: str) -> None:
        raise NotImplementedError(
            f"this compressed-tensors checkpoint has {what}; pagedlm runs {SUPPORTED}."
        )

    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        refuse(f"{len(groups)} config_groups (one is supported)")
    (group,) = groups.values()
    fmt = group.get("format") or qc.get("format")
    if fmt != "int-quantized":
        refuse(f"format {fmt!r}")
    if sorted(group.get("targets") or []) != ["Linear"]:
        refuse(f"targets {group.get('targets')!r}")
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    want_w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for key, value in want_w.items():
        if w.get(key) != value:
            refuse(f"weights.{key}={w.get(key)!r}")
    if w.get("dynamic"):
        refuse("dynamic weights")
    if not a:
        refuse("no input_activations (weight-only)")
    for key, value in {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}.items():
        if a.get(key) != value:
            refuse(f"input_activations.{key}={a.get(key)!r}")
    ignore = [i for i in qc.get("ignore") or [] if i != "lm_head"]
    if ignore:
        refuse(f"ignore entries {ignore[:4]!r} (only 'lm_head' stays unquantized)")
    if qc.get("kv_cache_scheme"):
        refuse("a kv_cache_scheme")
