"""LLM.generate as vLLM users call it: prompt forms, ordering, ids, errors, progress bar."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedlm import LLM, SamplingParams, TokensPrompt
from pagedlm.exceptions import VLLMValidationError


@pytest.fixture(scope="module")
def llm(tiny_qwen2) -> LLM:
    return LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, seed=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_prompt_forms_and_output_fields(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    outs = llm.generate(
        [
            "The capital of France is",
            {"prompt": "The capital of France is"},
            {"prompt_token_ids": ids},
            TokensPrompt(prompt_token_ids=ids, prompt="echo"),
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == [
        "The capital of France is",
        "The capital of France is",
        None,
        "echo",
    ]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    first = outs[0].outputs[0]
    assert first.index == 0 and first.finish_reason == "length" and first.stop_reason is None
    assert first.cumulative_logprob is None and first.logprobs is None
    assert first.text == tok.decode(first.token_ids)
    assert all(o.finished for o in outs)
    # a bare list of ints is ONE prompt
    single = llm.generate(ids, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt_token_ids == ids


def test_request_ids_increase_across_calls_and_order_is_input_order(llm: LLM) -> None:
    prompts = ["a b c d e f g h i j k l", "Hi", "The quick brown fox", "x"]
    a = llm.generate(prompts, GREEDY, use_tqdm=False)
    b = llm.generate(prompts, GREEDY, use_tqdm=False)
    ids_a, ids_b = [int(o.request_id) for o in a], [int(o.request_id) for o in b]
    assert ids_a == sorted(ids_a) and ids_b[0] == ids_a[-1] + 1
    assert [o.prompt for o in a] == prompts
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_params_list_is_paired_per_prompt(llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=k) for k in (1, 3)]
    outs = llm.generate(["Hello", "World"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3]
    assert params[0].output_kind.name == "FINAL_ONLY"  # vLLM mutates the caller's object
    with pytest.raises(ValueError, match=r"lengths of prompts \(2\) and params \(1\)"):
        llm.generate(["Hello", "World"], params[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["Hello", "World"], GREEDY, priority=[], use_tqdm=False)
    assert len(llm.generate("Hello", GREEDY, priority=[0], use_tqdm=False)) == 1


def test_too_long_prompt_fails_before_anything_runs(llm: LLM) -> None:
    long_ids = list(range(5, 75))  # 70 > max_model_len 64
    with pytest.raises(VLLMValidationError, match="maximum context length is 64.*70 input tokens"):
        llm.generate(["ok", {"prompt_token_ids": long_ids}], GREEDY, use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match=r"\(at least 1\)"):
        llm.generate({"prompt_token_ids": list(range(5, 69))}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="Token id 999999 is out of vocabulary"):
        llm.generate({"prompt_token_ids": [999999]}, GREEDY, use_tqdm=False)
    # the engine still works afterwards
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].finished


def test_max_tokens_none_fills_to_max_model_len(llm: LLM) -> None:
    ids = list(range(5, 45))
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 64 - 40
    assert out.outputs[0].finish_reason == "length"


def test_n_samples_with_seed(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    out = llm.generate("Hello, my name is", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    again = llm.generate("Hello, my name is", params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_seeded_request_independent_of_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    alone = llm.generate("The future of AI is", seeded, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(
        ["x y z", "The future of AI is", "Hello"], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_progress_bar(llm: LLM, capsys) -> None:
    llm.generate(["Hello", "World"], GREEDY)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "est. speed input:" in err and "toks/s" in err
    llm.generate(["Hello", "World"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_unknown_kwarg_is_a_type_error(tiny_qwen2) -> None:
    with pytest.raises(TypeError, match="max_modle_len"):
        LLM(str(tiny_qwen2), max_modle_len=64)


def test_default_sampling_params_from_generation_config(tiny_qwen2, tmp_path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_qwen2, model)
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "eos_token_id": [2, 7]})
    )
    llm = LLM(str(model), dtype="float32", max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == 3
    out = llm.generate("Hello", use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 3
    explicit = llm.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert len(explicit.outputs[0].token_ids) == 5


def test_skip_tokenizer_init(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 20, 30]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 5


def test_model_config_eos_stops_without_generation_config(tiny_model_factory, tmp_path) -> None:
    """No generation_config.json (GGUF files have none): the model config's EOS id ends
    generation, as vLLM's generation config derived from the model config does, even where the
    tokenizer names another EOS (tokenizer.ggml.eos_token_id <|im_end|> vs <|endoftext|>)."""
    base = tiny_model_factory("qwen2")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    tokens = LLM(str(base), dtype="float32").generate([[5, 6, 7]], greedy, use_tqdm=False)
    stop_at = tokens[0].outputs[0].token_ids[2]
    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "generation_config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = stop_at
    (model / "config.json").write_text(json.dumps(config))
    out = LLM(str(model), dtype="float32").generate([[5, 6, 7]], greedy, use_tqdm=False)
    first = tokens[0].outputs[0].token_ids.index(stop_at)
    assert out[0].outputs[0].token_ids == tokens[0].outputs[0].token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"


_PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}[{{ p.text }}]"
    "{% endfor %}{% endfor %}<assistant>"
)
_STRING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_chat_template_at_construction_and_content_formats(tiny_qwen2) -> None:
    """LLM(chat_template=...) is the default template of chat(); a call's template wins.
    chat_template_content_format: "string" joins text parts, "openai" passes them as a list,
    "auto" picks "openai" for a template that loops over a message's content, as vLLM does."""
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, chat_template=_STRING_TEMPLATE)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    plain = [{"role": "user", "content": "hi"}]

    def prompt(messages, **kwargs) -> str:
        out = llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
        return out[0].prompt

    assert prompt(plain) == "<user>hi<assistant>"
    assert prompt(parts) == "<user>a\nb<assistant>"
    assert prompt(parts, chat_template=_PARTS_TEMPLATE) == "<user>[a][b]<assistant>"  # auto
    assert prompt(plain, chat_template=_PARTS_TEMPLATE) == "<user>[hi]<assistant>"
    assert (
        prompt(parts, chat_template=_PARTS_TEMPLATE, chat_template_content_format="string")
        == "<user>[][][]<assistant>"  # the loop walks the characters of "a\nb"
    )
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        prompt(plain, chat_template_content_format="markdown")
