"""Where models come from: sharded safetensors, a llama GGUF written here, hub ids offline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedlm import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 40)), [42] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _hf_tokens(model_dir) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def _ours(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=128, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_sharded_safetensors_checkpoint(tiny_llama, tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (sharded / name).write_bytes((tiny_llama / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _ours(str(sharded)) == _hf_tokens(tiny_llama)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to llama q/k projections."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_llama_gguf_written_like_llama_cpp_matches_transformers(tiny_llama, tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    cfg = model.config
    path = tmp_path / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[part]}.{kind}"
            if part == "self_attn.q_proj":
                data = _llama_cpp_permute(data, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert _ours(str(path), tokenizer=str(tiny_llama)) == _hf_tokens(tiny_llama)


def test_truncated_gguf_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        LLM(str(bad))


def test_hub_id_offline_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="offline|local directory"):
        LLM("some-org/some-model-that-is-not-cached")


def test_missing_local_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
