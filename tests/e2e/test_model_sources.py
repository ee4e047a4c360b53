"""Where models come from: sharded safetensors, a llama GGUF written here, hub ids offline."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedlm import LLM, SamplingParams
from tests.gguf_writer import write_llama_gguf

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
    _copy_tokenizer(tiny_llama, sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _ours(str(sharded)) == _hf_tokens(tiny_llama)


def _copy_tokenizer(source, target) -> None:
    """The tokenizer files there are (transformers 5 writes no special_tokens_map.json)."""
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens_map", "chat_template")):
            (target / path.name).write_bytes(path.read_bytes())


def _as_bin_checkpoint(source, target, **save_kwargs):
    """pytorch_model*.bin written with huggingface_hub: transformers 5 saves safetensors only."""
    from huggingface_hub import save_torch_state_dict

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.save_pretrained(target)
    save_torch_state_dict(model.state_dict(), target, safe_serialization=False, **save_kwargs)
    _copy_tokenizer(source, target)
    assert not list(target.glob("*.safetensors")) and list(target.glob("pytorch_model*.bin"))
    return target


def test_pytorch_bin_checkpoint(tiny_llama, tmp_path) -> None:
    """pytorch_model*.bin only (sharded too): read with torch.load(weights_only=True)."""
    whole = _as_bin_checkpoint(tiny_llama, tmp_path / "bin")
    sharded = _as_bin_checkpoint(tiny_llama, tmp_path / "bin-sharded", max_shard_size="100KB")
    assert len(list(sharded.glob("pytorch_model*.bin"))) > 1
    assert _ours(str(whole)) == _ours(str(sharded)) == _hf_tokens(tiny_llama)


def test_pickled_code_in_a_bin_checkpoint_is_refused(tiny_llama, tmp_path) -> None:
    import pickle

    target = _as_bin_checkpoint(tiny_llama, tmp_path / "bin")

    class Payload:
        def __reduce__(self):
            return (print, ("code ran while loading",))

    with (target / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"model.embed_tokens.weight": Payload()}, f)
    with pytest.raises(ValueError, match="weights_only"):
        LLM(str(target), dtype="float32", max_model_len=128)


def test_llama_gguf_written_like_llama_cpp_matches_transformers(tiny_llama, tmp_path) -> None:
    pytest.importorskip("gguf")
    path = write_llama_gguf(tiny_llama, tmp_path / "tiny-llama.gguf")
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
