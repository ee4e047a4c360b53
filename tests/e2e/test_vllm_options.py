"""vLLM's loading and naming options do what vLLM's do (tiny models; the hub is faked).

tests/unit/test_vllm_fields.py requires a behaviour test naming each option pagedlm honours;
these are the ones no other file covers.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.openai.run_batch import main as run_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def _tokens(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_load_format_dummy_gives_random_weights(tiny_qwen2) -> None:
    real = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    dummy = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, load_format="dummy")
    weight = "model.embed_tokens.weight"

    def first_weight(llm: LLM) -> torch.Tensor:
        return llm.collective_rpc(
            lambda worker, name=weight: dict(worker.model_runner.model.named_parameters())[
                name
            ].clone()
        )[0]

    assert not torch.equal(first_weight(real), first_weight(dummy))
    assert len(_tokens(dummy)) == 6


def test_hf_overrides_change_the_model_config(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", hf_overrides={"max_position_embeddings": 48})
    assert llm.model_config.max_model_len == 48
    assert LLM(str(tiny_qwen2), dtype="float32", hf_overrides={}).model_config.max_model_len == 512


def test_tokenizer_mode(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, tokenizer_mode="hf")
    assert llm.get_tokenizer().is_fast
    with pytest.raises(NotImplementedError, match="tokenizer_mode='mistral'"):
        LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, tokenizer_mode="mistral")


def test_hub_options_reach_the_hub_and_transformers(tiny_qwen2, monkeypatch) -> None:
    """revision / hf_token go to snapshot_download; tokenizer_revision and trust_remote_code to
    transformers (the hub itself is faked: no network here)."""
    import huggingface_hub
    from transformers import AutoConfig, AutoTokenizer

    calls: dict[str, dict] = {}

    def fake_snapshot_download(repo_id, **kwargs):
        calls["hub"] = {"repo_id": repo_id, **kwargs}
        return str(tiny_qwen2)

    def recording(name, original):
        def wrapped(*args, **kwargs):
            calls[name] = kwargs
            return original(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(
        AutoConfig, "from_pretrained", recording("config", AutoConfig.from_pretrained)
    )
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", recording("tokenizer", AutoTokenizer.from_pretrained)
    )
    llm = LLM(
        "some-org/tiny",
        dtype="float32",
        max_model_len=64,
        revision="v1.2",
        hf_token="hf_secret",
        tokenizer_revision="tok-v3",
        trust_remote_code=True,
    )
    assert calls["hub"]["repo_id"] == "some-org/tiny"
    assert calls["hub"]["revision"] == "v1.2" and calls["hub"]["token"] == "hf_secret"
    assert calls["config"]["trust_remote_code"] is True
    assert calls["tokenizer"]["revision"] == "tok-v3"
    assert calls["tokenizer"]["trust_remote_code"] is True
    assert len(_tokens(llm)) == 6


def test_served_model_name_names_run_batch_responses(tiny_qwen2, tmp_path) -> None:
    body = {"model": "x", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    request = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(request) + "\n")
    args = ["--model", str(tiny_qwen2), "--max-model-len", "64", "--dtype", "float32"]
    assert run_batch(["-i", str(inp), "-o", str(out), *args, "--served-model-name", "mine"]) == 0
    assert json.loads(out.read_text())["response"]["body"]["model"] == "mine"
    assert run_batch(["-i", str(inp), "-o", str(out), *args]) == 0
    assert json.loads(out.read_text())["response"]["body"]["model"] == str(tiny_qwen2)


@pytest.mark.parametrize("speculative", [False, True])
def test_logprob_token_ids_returns_exactly_those_ids(tiny_qwen2, speculative: bool) -> None:
    """Each position holds the sampled token then the asked ids, with the same values as the
    whole-vocabulary logprobs; other requests of the batch keep their top-k."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=64,
        speculative_config=spec if speculative else None,
        max_logprobs=-1,
    )
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}  # repeats: n-gram drafts exist
    chosen = [3, 200, 11]
    full, picked, top = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=-1),
            SamplingParams(
                temperature=0.0, max_tokens=5, ignore_eos=True, logprob_token_ids=chosen
            ),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
        ],
        use_tqdm=False,
    )
    assert picked.outputs[0].token_ids == full.outputs[0].token_ids
    for token, row, whole, top_row in zip(
        picked.outputs[0].token_ids,
        picked.outputs[0].logprobs,
        full.outputs[0].logprobs,
        top.outputs[0].logprobs,
        strict=True,
    ):
        assert set(row) == {token, *chosen}
        for tid, lp in row.items():
            assert lp.logprob == pytest.approx(whole[tid].logprob, abs=1e-5)
        assert len(top_row) in (2, 3)  # top-2 plus the sampled token when it is not among them
    assert picked.outputs[0].cumulative_logprob == pytest.approx(
        full.outputs[0].cumulative_logprob, abs=1e-4
    )
    both = SamplingParams(temperature=0.0, max_tokens=2, logprobs=3, logprob_token_ids=chosen)
    (out,) = llm.generate(prompt, both, use_tqdm=False)
    assert all(
        set(row) == {t, *chosen}
        for t, row in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
    )


def _vllm_defaults(cls_name: str) -> dict:
    from pathlib import Path

    fields = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_fields.json").read_text())
    return {
        k: v
        for k, v in fields[cls_name].items()
        if not (isinstance(v, dict) and ("__repr__" in v or "__required__" in v))
    }


def test_every_vllm_default_at_once_builds_a_working_engine(tiny_qwen2) -> None:
    """vLLM's scripts and test fixtures pass defaults explicitly: all of LLM's at once (and all
    of EngineArgs' through LLM's keyword arguments) give a working engine."""
    llm_defaults = {k: v for k, v in _vllm_defaults("LLM").items() if k != "model"}
    engine_defaults = {
        k: v for k, v in _vllm_defaults("EngineArgs").items() if k not in ("model", *llm_defaults)
    }
    engine_defaults["max_model_len"] = 64  # vLLM's default (None) would be the model's 512
    llm = LLM(str(tiny_qwen2), **llm_defaults, **engine_defaults)
    assert len(_tokens(llm)) == 6


def test_model_config_queries_scripts_read(tiny_qwen2) -> None:
    """vLLM's ModelConfig methods and properties (read by scripts and vLLM's tests)."""
    from types import SimpleNamespace

    config = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64).model_config
    assert (
        config.architectures == ["Qwen2ForCausalLM"]
        and config.architecture == config.architectures[0]
    )
    assert config.get_vocab_size() == 512 and config.get_hidden_size() == 64
    assert config.embedding_size == 64 and config.get_head_size() == 16
    assert config.get_total_num_kv_heads() == 2 and config.get_total_num_hidden_layers() == 2
    tp2 = SimpleNamespace(tensor_parallel_size=2)
    assert config.get_num_kv_heads(tp2) == 1 and config.get_num_attention_heads(tp2) == 2
    assert config.get_num_layers(tp2) == 2 and config.hf_text_config is config.hf_config
    assert not (config.is_multimodal_model or config.is_moe or config.is_quantized)
    assert not config.is_matryoshka and config.matryoshka_dimensions is None


def test_load_format_picks_the_checkpoint_kind(tiny_llama, tmp_path) -> None:
    """vLLM's load_format: "safetensors" / "pt" insist on that file kind, "auto" takes
    safetensors first; a kind the model lacks is a clear error."""
    import shutil

    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    both = tmp_path / "both"
    shutil.copytree(tiny_llama, both)  # config, tokenizer, model.safetensors
    state = load_file(both / "model.safetensors")
    save_torch_state_dict(state, both, safe_serialization=False)  # and pytorch_model.bin
    assert (both / "pytorch_model.bin").is_file()
    ref = _tokens(LLM(str(tiny_llama), dtype="float32", max_model_len=64))
    for fmt in ("auto", "safetensors", "pt"):
        assert _tokens(LLM(str(both), dtype="float32", max_model_len=64, load_format=fmt)) == ref
    with pytest.raises(ValueError, match="load_format='pt' but .* no pytorch_model"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=64, load_format="pt")
    with pytest.raises(ValueError, match="load_format='gguf' but"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=64, load_format="gguf")
    with pytest.raises(NotImplementedError, match="load_format='bitsandbytes'"):
        LLM(str(tiny_llama), load_format="bitsandbytes")


def test_enforce_eager_either_way_runs_the_same_eager_kernels(tiny_qwen2) -> None:
    """vLLM's default enforce_eager=False (compile where possible) is accepted: pagedlm's CPU
    kernels are eager either way, so both give the same tokens."""
    runs = [
        _tokens(LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, enforce_eager=eager))
        for eager in (False, True)
    ]
    assert runs[0] == runs[1]
