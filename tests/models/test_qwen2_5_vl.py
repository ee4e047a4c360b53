"""Qwen2.5-VL against Hugging Face transformers on a tiny random model (fp32): greedy tokens
and logprobs with images of several sizes, one or two per prompt, mixed with text-only prompts;
and the engine options that must not change outputs (prefix caching, chunks smaller than an
image, preemption)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.mm_models import hf_greedy_generate, make_tiny_qwen2_5_vl, random_image

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))


def _images(*sizes):
    return [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]


def _prompt(text: str, num_images: int) -> str:
    images = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return f"<|user|>{images}{text}</s><|assistant|>"


def hf_greedy(path, prompt_token_ids, images, max_tokens=MAX_TOKENS):
    """transformers' greedy tokens and their logprobs for the expanded prompt and images."""
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_token_ids])
    kwargs = {}
    if images:
        processed = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
        kwargs = dict(
            pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        )
    return hf_greedy_generate(model, prompt_token_ids, max_tokens, **kwargs)


CASES = [
    ("Describe.", [(100, 140)]),
    ("Compare these two.", [(56, 56), (224, 168)]),
    ("What is it?", [(300, 120)]),
    ("Only text here.", []),
]


def _requests(cases):
    return [
        {"prompt": _prompt(text, len(sizes)), "multi_modal_data": {"image": _images(*sizes)}}
        if sizes
        else _prompt(text, 0)
        for text, sizes in cases
    ]


def _run(path, requests, **engine_args):
    engine_args.setdefault("max_model_len", 512)
    llm = LLM(str(path), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    return llm, llm.generate(requests, params, use_tqdm=False)


def test_matches_transformers(qwen_vl):
    llm, outputs = _run(qwen_vl, _requests(CASES))
    for (text, sizes), output in zip(CASES, outputs, strict=True):
        images = _images(*sizes)
        processed = llm.llm_engine.input_processor.mm_processor
        expected_len = sum(
            int(processed.process_image(im, {})["image_grid_thw"].prod()) // 4 for im in images
        )
        assert output.prompt_token_ids.count(processed.image_token_id) == expected_len
        tokens, logprobs = hf_greedy(qwen_vl, output.prompt_token_ids, images)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, text
        ours = [next(iter(lp.values())).logprob for lp in completion.logprobs]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ours, logprobs, strict=True)), (
            text
        )


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=16),  # chunks smaller than every image
        dict(block_size=4, num_gpu_blocks_override=56, max_model_len=224),  # preemption
    ],
    ids=["no-prefix-cache", "tiny-chunks", "tiny-kv-pool"],
)
def test_engine_options_keep_outputs(qwen_vl, engine_args):
    requests = _requests(CASES * 2)
    _, expected = _run(qwen_vl, requests)
    llm, got = _run(qwen_vl, requests, **engine_args)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for a, b in zip(expected, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_keys_on_the_image(qwen_vl):
    llm = LLM(str(qwen_vl), dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    image_a, image_b = _images((224, 224), (224, 224))[0], random_image(224, 224, seed=7)
    prompt = _prompt("Describe this image in detail.", 1)
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image_a}}, params)
    same = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image_a}}, params)
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image_b}}, params)
    assert first[0].num_cached_tokens == 0
    image_start = first[0].prompt_token_ids.index(
        llm.llm_engine.input_processor.mm_processor.image_token_id
    )
    assert same[0].num_cached_tokens > image_start  # the image's blocks are shared
    assert other[0].num_cached_tokens <= image_start  # only the text before the image


def test_tensor_parallel_and_int8(qwen_vl):
    """The text decoder shards over two ranks (the vision tower is replicated on each) and
    takes the int8 linear method; images reach every rank through the boundary's plain data."""
    requests = _requests(CASES)
    _, expected = _run(qwen_vl, requests)
    _, sharded = _run(qwen_vl, requests, tensor_parallel_size=2)
    for a, b in zip(expected, sharded, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    llm, quantized = _run(qwen_vl, requests, quantization="int8")
    (method,) = llm.apply_model(
        lambda model: type(model.language_model.model.layers[0].mlp.down_proj.quant_method).__name__
    )
    assert method != "UnquantizedLinearMethod"
    for a, b in zip(expected, quantized, strict=True):
        first = next(iter(a.outputs[0].logprobs[0].values())).logprob
        assert abs(next(iter(b.outputs[0].logprobs[0].values())).logprob - first) < 0.3
