"""Gemma 3 with vision against Hugging Face transformers on a tiny random model (fp32): the
image tokens attend to each other both ways inside the causal (and sliding-window) attention;
greedy tokens and logprobs equal transformers' with one and two images and text-only prompts,
with and without prefix caching, small chunks (images never cut) and preemption."""

from __future__ import annotations

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.mm_models import hf_greedy_generate, make_tiny_gemma3_vl, random_image

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def gemma_vl(tmp_path_factory):
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("tiny-gemma3-vl"))


def _prompt(text: str, num_images: int) -> str:
    return f"<|user|>{'<start_of_image>' * num_images}{text}</s><|assistant|>"


def hf_greedy(path, prompt_token_ids, images):
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_token_ids])
    kwargs = {}
    if images:
        processed = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
        kwargs = dict(
            pixel_values=processed["pixel_values"],
            token_type_ids=(ids == model.config.image_token_index).long(),
        )
    return hf_greedy_generate(model, prompt_token_ids, MAX_TOKENS, **kwargs)


CASES = [
    ("Describe.", [(100, 140)]),
    ("Compare these two pictures now.", [(56, 56), (224, 168)]),
    ("Only text here.", []),
]


def _requests(cases):
    out = []
    for text, sizes in cases:
        images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
        prompt = _prompt(text, len(sizes))
        out.append({"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt)
    return out


def _run(path, requests, **engine_args):
    engine_args.setdefault("max_model_len", 256)
    llm = LLM(str(path), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    return llm, llm.generate(requests, params, use_tqdm=False)


def test_matches_transformers(gemma_vl):
    requests = _requests(CASES)
    llm, outputs = _run(gemma_vl, requests)
    assert llm.llm_engine.vllm_config.scheduler_config.disable_chunked_mm_input
    for request, output in zip(requests, outputs, strict=True):
        images = request["multi_modal_data"]["image"] if isinstance(request, dict) else []
        tokens, logprobs = hf_greedy(gemma_vl, output.prompt_token_ids, images)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [next(iter(lp.values())).logprob for lp in completion.logprobs]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ours, logprobs, strict=True))


def test_images_attend_both_ways(gemma_vl, monkeypatch):
    """Without the bidirectional spans the outputs differ (the test above would be blind)."""
    from pagedlm.attention.cpu_attn import CPUAttentionBackend

    requests = _requests(CASES[:2])
    _, expected = _run(gemma_vl, requests)
    monkeypatch.setattr(CPUAttentionBackend, "_attend_span", staticmethod(_causal_rows))
    _, got = _run(gemma_vl, requests)
    assert any(
        a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(expected, got, strict=True)
    )


def _causal_rows(query, kv_cache, span, scale, window, k_scale, v_scale):
    """The span's rows attended causally (what the backend computes without spans)."""
    import torch.nn.functional as F

    from pagedlm.attention.cpu_attn import causal_mask, gather_kv

    q = query[span.row : span.row + span.num_rows].transpose(0, 1).unsqueeze(0)
    k, v = gather_kv(kv_cache, span.block_ids, span.end, k_scale, v_scale, q.dtype)
    mask = causal_mask(span.num_rows, span.end, window, q.device)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=12),  # chunks end before an image rather than inside it
        dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64),  # preemption
    ],
    ids=["no-prefix-cache", "small-chunks", "tiny-kv-pool"],
)
def test_engine_options_keep_outputs(gemma_vl, engine_args):
    requests = _requests(CASES * 3)
    _, expected = _run(gemma_vl, requests)
    llm, got = _run(gemma_vl, requests, **engine_args)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for a, b in zip(expected, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
