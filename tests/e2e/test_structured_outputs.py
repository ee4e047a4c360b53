"""Structured outputs on a tiny random model: whatever the model prefers, outputs obey the grammar.

A random model is the hard case: it never "wants" to follow the constraint, so every token of
a full match is the mask's doing.
"""

from __future__ import annotations

import json
import re

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams as SO

pytest.importorskip("xgrammar")

CHOICES = ["yes", "no way", "maybe later", '"quoted" \\ choice']
REGEXES = [r"[a-c]{3}-\d{2}", r"(cat|dog)s?", r"\d{1,3}(\.\d{1,2})?", r"[A-Z][a-z]{2,5}!"]
PROMPTS = ["Hello", "The capital of France is", "def reverse(s):", "To be or not"]


@pytest.fixture(scope="module")
def llm(tiny_qwen2) -> LLM:
    return LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, seed=0)


def _params(temperature: float, seed: int, so: SO | None, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_and_regex_full_match(llm: LLM, temperature: float) -> None:
    prompts, params, checks = [], [], []
    for seed, prompt in enumerate(PROMPTS):
        prompts.append(prompt)
        params.append(_params(temperature, seed, SO(choice=CHOICES)))
        checks.append(lambda text: text in CHOICES)
        for pattern in REGEXES:
            prompts.append(prompt)
            params.append(_params(temperature, seed, SO(regex=pattern)))
            checks.append(lambda text, p=pattern: re.fullmatch(p, text) is not None)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for check, out in zip(checks, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert completion.token_ids[-1] == llm.get_tokenizer().eos_token_id
        assert check(completion.text), completion.text


def test_mixed_batch_leaves_unconstrained_rows_alone(llm: LLM) -> None:
    """Requests without a grammar give the same tokens alone and next to constrained ones."""
    free = [_params(0.0, 0, None, 12), _params(1.0, 7, None, 12)]
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
        [free[0], _params(0.0, 0, SO(choice=CHOICES)), free[1], _params(1.0, 3, SO(regex="a+b"))],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert mixed[1].outputs[0].text in CHOICES
    assert re.fullmatch("a+b", mixed[3].outputs[0].text)


def test_json_schema_object_and_grammars(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["x", "y"]}},
        "required": ["ok", "kind"],
        "additionalProperties": False,
    }
    ebnf = 'root ::= "(" digit digit? ")"\ndigit ::= [0-9]'
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,4}/'
    params = [
        _params(1.0, 1, SO(json=schema, disable_any_whitespace=True), 60),
        _params(0.0, 0, SO(json=json.dumps(schema), disable_any_whitespace=True), 60),
        _params(0.0, 0, SO(grammar=ebnf), 10),
        _params(1.0, 2, SO(grammar=lark), 10),
    ]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for out in outs[:2]:
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert set(value) == {"ok", "kind"} and isinstance(value["ok"], bool)
        assert value["kind"] in ("x", "y")
    assert outs[2].finish_reason == "stop" and re.fullmatch(r"\(\d\d?\)", outs[2].text)
    assert outs[3].finish_reason == "stop" and re.fullmatch(r"<[a-z]{1,4}>", outs[3].text)
    # json_object: a random model rarely closes the object in a few tokens; it must open one
    objs = llm.generate(
        PROMPTS, [_params(1.0, s, SO(json_object=True), 8) for s in range(4)], use_tqdm=False
    )
    for out in objs:
        text = out.outputs[0].text
        assert text.lstrip()[:1] in ("{", "["), text
        if out.outputs[0].finish_reason == "stop":
            json.loads(text)


def test_n_children_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=5, structured_outputs=SO(choice=CHOICES))
    (out,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    assert len(out.outputs) == 4 and all(c.text in CHOICES for c in out.outputs)


def test_grammar_survives_preemption(tiny_qwen2) -> None:
    """Recompute preemption replays the tokens but never re-feeds the matcher."""
    llm = LLM(
        str(tiny_qwen2), dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=18
    )
    params = [_params(1.0, s, SO(regex=r"[a-z]{20}-[0-9]{8}"), 40) for s in range(6)]
    outs = llm.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for out in outs:
        assert re.fullmatch(r"[a-z]{20}-[0-9]{8}", out.outputs[0].text), out.outputs[0]


@pytest.mark.parametrize(
    "so,match",
    [
        (SO(regex="(abc"), "Invalid regex"),
        (SO(json='{"type": "foo"}'), "Invalid json"),
        (SO(json="{not json"), "Invalid JSON schema"),
        (SO(grammar="root ::= undefined_rule"), "Invalid grammar"),
        (SO(grammar="   "), "grammar cannot be empty"),
        (SO(choice=[]), "choice cannot be an empty list"),
        (SO(structural_tag="{oops"), "structural_tag"),
        (SO(json={"type": "object"}, whitespace_pattern=r"[ ]?"), "whitespace_pattern"),
    ],
)
def test_invalid_constraints_fail_at_generate(llm: LLM, so: SO, match: str) -> None:
    good = _params(0.0, 0, SO(choice=CHOICES))
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[:2], [good, _params(0.0, 0, so)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was left half-added


def test_compiled_once_per_constraint(llm: LLM) -> None:
    backend = llm.llm_engine.structured_output_manager.backend
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}}
    before = backend.num_compilations
    for _ in range(2):
        llm.generate(
            PROMPTS[:3],
            _params(0.0, 0, SO(json=schema, disable_any_whitespace=True), 3),
            use_tqdm=False,
        )
    llm.generate(PROMPTS[0], _params(0.0, 0, SO(json=json.dumps(schema))), use_tqdm=False)
    # the dict and its JSON string share a key only with the same whitespace option
    assert backend.num_compilations - before == 2


def test_needs_a_tokenizer(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="requires a tokenizer"):
        llm.generate(
            {"prompt_token_ids": [1, 2, 3]}, _params(0.0, 0, SO(regex="a")), use_tqdm=False
        )


def test_engine_config(tiny_qwen2) -> None:
    from pagedlm.config import StructuredOutputsConfig

    config = StructuredOutputsConfig.from_any({"disable_any_whitespace": True, "unknown": 1})
    assert config.disable_any_whitespace and config.backend == "auto"  # unknown keys dropped
    with pytest.raises(ValueError, match="not available"):
        LLM(str(tiny_qwen2), structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ValueError, match="not available"):
        so = SO(regex="a")
        so._backend = "guidance"
        LLM(str(tiny_qwen2), max_model_len=64).generate("x", _params(0.0, 0, so), use_tqdm=False)


def test_rejected_with_speculative_decoding(tiny_qwen2) -> None:
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(ValueError, match="not yet supported with speculative decoding"):
        llm.generate(PROMPTS[0], _params(0.0, 0, SO(regex="a+")), use_tqdm=False)


def test_multiprocess_executor(tiny_qwen2, llm: LLM) -> None:
    """The bitmask crosses the process boundary as plain data: same outputs as in-process."""
    mp_llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=128,
        seed=0,
        distributed_executor_backend="mp",
    )
    params = [_params(1.0, s, SO(regex=REGEXES[s % len(REGEXES)])) for s in range(4)]
    got = mp_llm.generate(PROMPTS, params, use_tqdm=False)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    mp_llm.llm_engine.shutdown()


def test_structural_tags(llm: LLM) -> None:
    """The current format constrains the whole output; the legacy {structures, triggers} one
    compiles (a random model never writes the trigger, so it stays free text)."""
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "Hello!"}}
    legacy = {
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    outs = llm.generate(
        PROMPTS[:2],
        [
            _params(1.0, 0, SO(structural_tag=json.dumps(tag)), 20),
            _params(1.0, 0, SO(structural_tag=json.dumps(legacy)), 4),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].text == "Hello!" and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("disable_additional_properties", [False, True])
def test_disable_additional_properties(llm: LLM, disable_additional_properties: bool) -> None:
    """xgrammar is strict, as in vLLM: keys the schema does not list are refused whether or not
    disable_additional_properties is set, and allowed where the schema says so."""
    props = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    manager = llm.llm_engine.structured_output_manager
    tokenizer = llm.get_tokenizer()

    def accepts(schema: dict, text: str) -> bool:
        so = SO(json=schema, disable_additional_properties=disable_additional_properties)
        grammar = manager.init_request(so).grammar
        return grammar.accept_tokens("r", tokenizer.encode(text, add_special_tokens=False))

    assert accepts(props, '{"a": 1}')
    assert not accepts(props, '{"a": 1, "b": 2}')
    assert accepts({**props, "additionalProperties": True}, '{"a": 1, "b": 2}')


def test_disable_any_whitespace_is_compact_json(llm: LLM) -> None:
    """vLLM's xgrammar backend compiles with separators (",", ":") then: no space at all."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    schema["required"] = ["a", "b"]
    manager = llm.llm_engine.structured_output_manager
    tokenizer = llm.get_tokenizer()
    for text, compact_ok in (('{"a":1,"b":2}', True), ('{"a": 1, "b": 2}', False)):
        for flag in (True, False):
            grammar = manager.init_request(SO(json=schema, disable_any_whitespace=flag)).grammar
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert grammar.accept_tokens("r", ids) is (compact_ok or not flag), (text, flag)
