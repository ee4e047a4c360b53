"""Write a Hugging Face llama checkpoint as a GGUF file the way llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pagedlm.model_loader.gguf_loader import gguf_tensor_name
from pagedlm.models.llama import rope_params


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to llama q/k projections."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(
    model_dir: Path, path: Path, quant: dict[str, gguf.GGMLQuantizationType] | None = None
) -> Path:
    """A GGUF of the llama checkpoint in `model_dir` (tokenizer: placeholder tokens): F32,
    except projections whose GGUF name part (e.g. "attn_v") is in `quant`, stored as that
    type (as llama.cpp's quantizer mixes types: Q4_K_M keeps attn_v at a higher precision)."""

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_params(cfg)[0])  # transformers 5: in rope_parameters
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied file has no output.weight (llama.cpp reads token_embd)
        data = tensor.numpy()
        gguf_name = gguf_tensor_name(name)
        if ".self_attn.q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        qtype = (quant or {}).get(gguf_name.split(".")[-2])
        if qtype is not None:
            raw = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
