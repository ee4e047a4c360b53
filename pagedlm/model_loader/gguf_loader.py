"""GGUF files: model config from the metadata, tensors dequantized under Hugging Face names.

Supported architectures: llama, qwen2, qwen3, gemma3. llama.cpp's converter permutes the rows of
q/k projections of llama-family models (for its RoPE layout) and stores Gemma norm weights as
(1 + w); both are undone here so the tensors equal the Hugging Face checkpoint's.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedlm.model_loader.gguf_reader import GGUFFile
from pagedlm.utils import release_mapped_pages

logger = logging.getLogger(__name__)

# llama.cpp's tensor names -> Hugging Face's (`gguf_tensor_name` the other way)
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFFile:
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def load_gguf_config(path: str | Path) -> Any:
    """A transformers config built from the GGUF metadata."""
    reader = _reader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(_ARCHITECTURES))}."
        )

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    vocab = len(reader.metadata["tokenizer.ggml.tokens"])
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // num_heads)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=get("attention.head_count_kv", num_heads),
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        tie_word_embeddings=tied,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        architectures=[_ARCHITECTURES[arch]],
    )
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        common["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": get("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        window = get("attention.sliding_window", 512)
        layers = common["num_hidden_layers"]
        return Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            sliding_window=window,
            query_pre_attn_scalar=head_dim,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
            ],
            rope_local_base_freq=10000.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=head_dim)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    from transformers import LlamaConfig

    return LlamaConfig(**common, head_dim=head_dim)


def _hf_name(arch: str, name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)", name)
    if m:
        layer, part, kind = m.groups()
        table = _GEMMA_LAYER_NAMES if arch == "gemma3" else GGUF_LAYER_NAMES
        if part not in table:
            return None
        return f"model.layers.{layer}.{table[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    return f"{GGUF_GLOBAL_NAMES[base]}.{kind}" if base in GGUF_GLOBAL_NAMES else None


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor of a llama/qwen2/qwen3 model (the inverse
    of `_hf_name`), as its converter writes it."""
    for gguf_base, hf_base in GGUF_GLOBAL_NAMES.items():
        if name.startswith(hf_base + "."):
            return gguf_base + name.removeprefix(hf_base)
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    part, kind = rest.rsplit(".", 1)
    gguf_part = next(g for g, hf in GGUF_LAYER_NAMES.items() if hf == part)
    return f"blk.{layer}.{gguf_part}.{kind}"


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> Hugging Face's half-split RoPE)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


# Weights of linear layers (and the LM head): kept as raw blocks under quantization="gguf".
_LINEAR_WEIGHT = re.compile(r"(_proj|lm_head)\.weight$")


def _keeps_blocks(name: str, tensor: Any, config: Any) -> bool:
    """Under quantization="gguf": linear weights the packed kernels compute with, and the
    embedding table (looked up row by row) when untied, or when tied and of a type the
    packed kernels compute with (the LM head packs it); the rest is decoded to dense tensors."""
    from pagedlm.kernels.gguf_pack import can_pack

    if _LINEAR_WEIGHT.search(name):
        return can_pack(tensor.ggml_type, tensor.shape)
    from pagedlm.kernels.gguf_quants import PLAIN_TYPES

    if name != "model.embed_tokens.weight" or tensor.ggml_type in PLAIN_TYPES:
        return False
    tied = getattr(config, "tie_word_embeddings", False)
    return not tied or can_pack(tensor.ggml_type, tensor.shape)


def iterate_gguf(
    path: str | Path,
    config: Any,
    quantization: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor) for every tensor of the file: matrices in `dtype` (decoded
    in fp32 and rounded once, as copying into a `dtype` parameter would; half the transient
    memory of fp32 for bf16 models), vectors in fp32; under quantization="gguf" linear
    weights of types with packed kernels come as GGUFRawTensor (raw blocks) instead."""
    from pagedlm.kernels.gguf_quants import dequantize
    from pagedlm.layers.quantization.gguf import GGUFRawTensor

    # A mapping of its own, not the cached reader's: once the packed copies are made and the
    # raw views dropped (process_weights_after_loading), it is unmapped and the file's pages
    # leave this process's memory (the cached reader keeps only the metadata pages it read).
    reader = GGUFFile(str(path))
    arch = _field(reader, "general.architecture")
    for tensor in reader.tensors:
        name = _hf_name(arch, tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no counterpart in {arch} models")
        raw = reader.tensor_bytes(tensor)
        if quantization == "gguf" and _keeps_blocks(name, tensor, config):
            rows = tensor.shape[0]
            with warnings.catch_warnings():  # read-only mapping; the packer only reads it
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(np.asarray(raw)).view(rows, -1)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads
                if "k_proj" in name:
                    heads = config.num_key_value_heads
                data = _unpermute(data, heads)  # a copy
            # only a view of the mapping may have its pages released (on a copy, madvise
            # would zero live memory); a copy's source pages go now
            file_backed = data.untyped_storage().data_ptr() == raw.ctypes.data
            if not file_backed:
                release_mapped_pages(raw.ctypes.data, raw.nbytes)
            yield name, GGUFRawTensor(data, tensor.ggml_type, tensor.shape, file_backed)
            continue
        matrix = len(tensor.shape) == 2
        weight = dequantize(raw, tensor.ggml_type, tensor.shape, dtype if matrix else torch.float32)
        release_mapped_pages(raw.ctypes.data, raw.nbytes)  # decoded: the file's pages go
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads
            if "k_proj" in name:
                heads = config.num_key_value_heads
            weight = _unpermute(weight, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1.0
        yield name, weight


def gguf_chat_template(path: str | Path) -> str | None:
    return _field(_reader(str(path)), "tokenizer.chat_template")


def load_gguf_tokenizer(path: str | Path, cache_root: Path) -> Any:
    """The GGUF's tokenizer as a transformers fast tokenizer, converted once per transformers
    version and cached (transformers 5 converts some GGUF tokenizers differently, Gemma's as BPE
    with merges, and misreads the Unigram files transformers 4 saved for them)."""
    import transformers
    from transformers import AutoTokenizer

    path = Path(path)
    stat = path.stat()
    cached = cache_root / f"{path.name}.{stat.st_size}.tf{transformers.__version__}.tokenizer"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("Converting the tokenizer of %s (once)", path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = gguf_chat_template(path)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(cached))
    except OSError as e:
        logger.warning("Could not cache the converted tokenizer in %s: %s", cached, e)
    return tokenizer
