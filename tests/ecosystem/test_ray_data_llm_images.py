"""Ray Data LLM's vLLM processor with its multimodal stages, unchanged, on pagedlm through the
alias (local 2-CPU cluster): image chats give what LLM.chat gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams
from tests.ecosystem.conftest import result_line
from tests.ecosystem.ray_image_rows import SAMPLING, conversations, to_messages
from tests.mm_models import make_tiny_qwen2_5_vl

pytest.importorskip("ray.data.llm")

JOB = Path(__file__).with_name("ray_data_llm_image_job.py")


@pytest.fixture(scope="module")
def tiny_qwen2_5_vl_no_bos(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL with a tokenizer that adds no BOS, as Qwen2.5-VL's own: Ray's
    Tokenize stage calls tokenizer(prompt) (special tokens added) where LLM.chat tokenizes
    the rendered template with add_special_tokens=False, on vLLM as here."""
    path = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl-ray"))
    tokenizer_json = path / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    spec["post_processor"] = None
    tokenizer_json.write_text(json.dumps(spec))
    return path


@pytest.mark.slow
def test_ray_data_llm_image_chat_matches_llm_chat(
    run_client, tiny_qwen2_5_vl_no_bos, tmp_path
) -> None:
    stdout = run_client(JOB, args=(tiny_qwen2_5_vl_no_bos, tmp_path / "work"), timeout=900)
    stages = [line for line in stdout.splitlines() if line.startswith("STAGES ")]
    assert json.loads(stages[-1][len("STAGES ") :]) == [
        "PrepareMultimodalStage",
        "ChatTemplateStage",
        "TokenizeStage",
        "vLLMEngineStage",
        "DetokenizeStage",
    ]
    got = result_line(stdout)
    convs = [to_messages(json.dumps(c)) for c in conversations()]
    assert [r["id"] for r in got] == list(range(len(convs)))

    llm = LLM(str(tiny_qwen2_5_vl_no_bos), dtype="float32", max_model_len=512)
    want = llm.chat(convs, SamplingParams(**SAMPLING), use_tqdm=False)
    tok = llm.get_tokenizer()
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    pads = []
    for row, ref in zip(got, want, strict=True):
        assert row["prompt"] == ref.prompt  # Ray's ChatTemplate stage rendered LLM.chat's text
        # the engine's prompt: the image tokens expanded, as for LLM.chat
        assert row["prompt_token_ids"] == ref.prompt_token_ids
        assert row["tokens"] == ref.outputs[0].token_ids
        # Ray's Detokenize stage decodes the whole output (batch_decode): a trailing partial
        # UTF-8 character shows as U+FFFD there while LLM's incremental text holds it back.
        assert row["answer"] == tok.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
        assert row["answer"].startswith(ref.outputs[0].text)
        pads.append(row["prompt_token_ids"].count(image_pad))
    # one image, two images, text only, an image_pil part, two turns with an image each
    assert pads[2] == 0 and all(p > 0 for i, p in enumerate(pads) if i != 2)
    assert pads[1] > pads[0] and pads[4] > pads[0]


def test_alias_parse_chat_messages(run_client, tiny_qwen2_5_vl_no_bos) -> None:
    """What Ray's PrepareMultimodal stage calls: vLLM-style ModelConfig(model=, dtype=) and
    parse_chat_messages_async, on pagedlm's config and chat parser."""
    got = result_line(
        run_client(
            f"""
            import asyncio, json
            import pagedlm.config
            from vllm.config import ModelConfig
            from vllm.entrypoints.chat_utils import parse_chat_messages_async
            from tests.mm_models import random_image

            config = ModelConfig(model={str(tiny_qwen2_5_vl_no_bos)!r}, dtype="float32")
            assert type(config) is pagedlm.config.ModelConfig and isinstance(config, ModelConfig)
            try:
                ModelConfig(model={str(tiny_qwen2_5_vl_no_bos)!r}, no_such_option=1)
                raise AssertionError("an unknown option was accepted")
            except TypeError as e:
                assert "no_such_option" in str(e), e
            image = random_image(56, 56)
            messages = [
                {{"role": "system", "content": "Be brief."}},
                {{"role": "user", "content": [
                    {{"type": "image_pil", "image_pil": image, "uuid": "cat"}},
                    {{"type": "text", "text": "Describe."}},
                ]}},
            ]
            out = {{}}
            for fmt in ("string", "openai"):
                conv, data, uuids = asyncio.run(parse_chat_messages_async(messages, config, fmt))
                assert data["image"] == [image]
                out[fmt] = [conv, uuids]
            conv, data, uuids = asyncio.run(
                parse_chat_messages_async([{{"role": "user", "content": "Hi"}}], config)
            )
            out["text"] = [conv, data, uuids]
            print("RESULT " + json.dumps(
                [str(config.dtype), config.max_model_len, config.architecture, out]
            ))
            """,
            timeout=300,
        )
    )
    assert got[:3] == ["torch.float32", 1024, "Qwen2_5_VLForConditionalGeneration"]
    system = {"role": "system", "content": "Be brief."}
    string, uuids = got[3]["string"]
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert string == [system, {"role": "user", "content": f"{placeholder}\nDescribe."}]
    assert uuids == {"image": ["cat"]}
    openai, _ = got[3]["openai"]
    parts = [{"type": "image"}, {"type": "text", "text": "Describe."}]
    assert openai[1] == {"role": "user", "content": parts}
    assert got[3]["text"] == [[{"role": "user", "content": "Hi"}], None, None]
