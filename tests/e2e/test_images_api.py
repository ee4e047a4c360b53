"""The image API on a tiny Qwen2.5-VL: vLLM's prompt and engine options, the caches, bad
inputs (each a clear error that leaves the engine serving), and a failure in the vision
encoder costing its own request alone."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from pagedlm import LLM, LLMEngine, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from tests.mm_models import make_tiny_qwen2_5_vl, random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt(num_images: int = 1, text: str = "Describe.") -> str:
    return f"<|user|>{IMAGE * num_images}{text}</s><|assistant|>"


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl-api"))


@pytest.fixture(scope="module")
def llm(qwen_vl):
    return LLM(str(qwen_vl), dtype="float32", max_model_len=512, limit_mm_per_prompt={"image": 2})


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _serves(llm: LLM) -> None:
    out = llm.generate({"prompt": prompt(), "multi_modal_data": {"image": random_image(64, 64)}})
    assert len(out[0].outputs[0].token_ids) > 0
    assert not llm.llm_engine.has_unfinished_requests()


BAD = [
    ({"image": [random_image(56, 56)] * 3}, 3, ValueError, "At most 2 image"),
    ({"image": [random_image(56, 56)] * 2}, 1, ValueError, "1 image placeholder"),
    ({"image": [random_image(56, 56)]}, 2, ValueError, "2 image placeholder"),
    ({"image": "not an image"}, 1, ValueError, "image"),
    ({"image": object()}, 1, ValueError, "image"),
    ({"video": [np.zeros((2, 8, 8, 3), np.uint8)]}, 1, NotImplementedError, "video"),
    ({"audio": [np.zeros(16)]}, 1, NotImplementedError, "audio"),
    ({"pointcloud": [1]}, 1, ValueError, "modality"),
]


@pytest.mark.parametrize("mm_data,num_placeholders,error,match", BAD)
def test_bad_inputs_are_clear_errors_and_lose_nothing(llm, mm_data, num_placeholders, error, match):
    good = {"prompt": prompt(), "multi_modal_data": {"image": random_image(80, 60)}}
    bad = {"prompt": prompt(num_placeholders), "multi_modal_data": mm_data}
    with pytest.raises(error, match=match):
        llm.generate([good, bad], GREEDY)
    _serves(llm)


def test_limit_mm_per_prompt_is_checked_at_construction(qwen_vl):
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineArgs(model=str(qwen_vl), limit_mm_per_prompt={"image": -1}).create_engine_config()


def test_image_options_on_a_text_model(tiny_qwen2):
    with pytest.raises(ValueError, match="text-only"):
        LLM(str(tiny_qwen2), dtype="float32", mm_processor_kwargs={"max_pixels": 1})
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="does not take images"):
        llm.generate({"prompt": "a", "multi_modal_data": {"image": random_image(8, 8)}})
    with pytest.raises(ValueError, match="text-only"):
        llm.generate(["a"], GREEDY, mm_processor_kwargs={"max_pixels": 1})
    assert llm.generate(["a"], GREEDY)[0].outputs[0].token_ids


def test_mm_processor_kwargs_per_call_prompt_and_engine(qwen_vl, llm):
    image = random_image(224, 224)
    image_id = llm.llm_engine.input_processor.mm_processor.image_token_id

    def num_image_tokens(out) -> int:
        return out[0].prompt_token_ids.count(image_id)

    base = num_image_tokens(
        llm.generate({"prompt": prompt(), "multi_modal_data": {"image": image}})
    )
    small = {"max_pixels": 28 * 28 * 4}
    per_call = llm.generate(
        {"prompt": prompt(), "multi_modal_data": {"image": image}}, mm_processor_kwargs=small
    )
    per_prompt = llm.generate(
        {"prompt": prompt(), "multi_modal_data": {"image": image}, "mm_processor_kwargs": small}
    )
    assert num_image_tokens(per_call) == num_image_tokens(per_prompt) == 4 < base
    engine = LLM(str(qwen_vl), dtype="float32", max_model_len=512, mm_processor_kwargs=small)
    out = engine.generate({"prompt": prompt(), "multi_modal_data": {"image": image}})
    assert num_image_tokens(out) == 4


def test_processor_cache_encoder_cache_and_reset_mm_cache(qwen_vl):
    llm = LLM(str(qwen_vl), dtype="float32", max_model_len=512, disable_log_stats=False)
    image = random_image(120, 90)
    request = {"prompt": prompt(), "multi_modal_data": {"image": image}}
    first = llm.generate([request, request], GREEDY)
    processor = llm.llm_engine.input_processor.mm_processor
    assert len(processor.cache) == 1
    manager = llm.llm_engine.scheduler.encoder_cache_manager
    assert len(manager.cached) == 1  # one encode for both requests, kept while unused
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:mm_cache_queries"] == 2 and metrics["vllm:mm_cache_hits"] == 1
    llm.reset_mm_cache()
    assert len(processor.cache) == 0 and not manager.cached
    again = llm.generate([request], GREEDY)
    assert _tokens(again) == _tokens(first)[:1]
    without = LLM(str(qwen_vl), dtype="float32", max_model_len=512, mm_processor_cache_gb=0)
    assert _tokens(without.generate([request], GREEDY)) == _tokens(first)[:1]
    assert len(without.llm_engine.input_processor.mm_processor.cache) == 0


def test_multi_modal_uuids_stand_in_for_content_hashes(llm):
    a, b = random_image(64, 64, seed=1), random_image(64, 64, seed=2)
    same_id = {"image": ["photo-1"]}
    llm.generate(
        {"prompt": prompt(), "multi_modal_data": {"image": a}, "multi_modal_uuids": same_id}
    )
    # a different picture under the same uuid is taken as the same image (vLLM's contract)
    out = llm.generate(
        {"prompt": prompt(), "multi_modal_data": {"image": b}, "multi_modal_uuids": same_id}
    )
    assert out[0].num_cached_tokens > 0


def test_disable_chunked_mm_input_never_cuts_an_image(qwen_vl):
    requests = [
        {
            "prompt": prompt(2),
            "multi_modal_data": {"image": [random_image(200, 100), random_image(90, 90)]},
        },
        {"prompt": prompt(1), "multi_modal_data": {"image": random_image(150, 150)}},
    ]
    expected = LLM(str(qwen_vl), dtype="float32", max_model_len=512).generate(requests, GREEDY)
    llm = LLM(
        str(qwen_vl),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=40,
        disable_chunked_mm_input=True,
    )
    assert _tokens(llm.generate(requests, GREEDY)) == _tokens(expected)
    big = {"prompt": prompt(1), "multi_modal_data": {"image": random_image(400, 400)}}
    with pytest.raises(ValueError, match="max_num_batched_tokens=40"):
        llm.generate(big, GREEDY)


def test_n_enqueue_engine_and_async_paths(qwen_vl, llm):
    request = {"prompt": prompt(), "multi_modal_data": {"image": random_image(100, 70)}}
    expected = _tokens(llm.generate(request, GREEDY))[0]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=2, ignore_eos=True)
    two = llm.generate(request, sampled)
    assert [len(c.token_ids) for c in two[0].outputs] == [4, 4]
    assert [c.token_ids for c in two[0].outputs] == [
        c.token_ids for c in llm.generate(request, sampled)[0].outputs
    ]
    llm.enqueue(request, GREEDY)
    assert _tokens(llm.wait_for_completion()) == [expected]

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(qwen_vl), dtype="float32", max_model_len=512)
    )
    engine.add_request("x", request, GREEDY)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == expected

    from pagedlm.engine.async_llm import AsyncLLM

    async def run() -> list[int]:
        async_llm = AsyncLLM.from_engine_args(
            EngineArgs(model=str(qwen_vl), dtype="float32", max_model_len=512)
        )
        try:
            async for out in async_llm.generate(request, GREEDY, request_id="a"):
                last = out
            return last.outputs[0].token_ids
        finally:
            async_llm.shutdown()

    assert asyncio.run(run()) == expected


def test_a_failing_encode_costs_its_own_request(qwen_vl):
    """The vision encoder raising for one image fails that request ("error"); the others in
    the same step finish as usual."""
    llm = LLM(str(qwen_vl), dtype="float32", max_model_len=512)
    images = [random_image(56, 56), random_image(300, 300), random_image(90, 60)]
    requests = [{"prompt": prompt(), "multi_modal_data": {"image": im}} for im in images]
    expected = _tokens(llm.generate(requests, GREEDY))
    llm.reset_mm_cache()

    def break_big_images(model) -> None:
        encode = model.embed_multimodal

        def embed_multimodal(features):
            if any(int(f.data["image_grid_thw"].prod()) > 100 for f in features):
                raise RuntimeError("encoder failure")
            return encode(features)

        model.embed_multimodal = embed_multimodal

    llm.apply_model(break_big_images)
    out = llm.generate(requests, GREEDY)
    assert out[1].outputs[0].finish_reason == "error"
    assert [out[0].outputs[0].token_ids, out[2].outputs[0].token_ids] == [expected[0], expected[2]]


def test_numpy_images_and_undecodable_bytes(llm):
    array = np.asarray(random_image(64, 48))
    by_array = llm.generate({"prompt": prompt(), "multi_modal_data": {"image": array}}, GREEDY)
    by_pil = llm.generate(
        {"prompt": prompt(), "multi_modal_data": {"image": random_image(64, 48)}}, GREEDY
    )
    assert _tokens(by_array) == _tokens(by_pil)
    buffer = io.BytesIO(b"not a png")
    with pytest.raises(ValueError):
        llm.generate({"prompt": prompt(), "multi_modal_data": {"image": buffer}}, GREEDY)
    _serves(llm)


def test_what_images_do_not_combine_with_is_refused_by_name(qwen_vl, llm):
    from pagedlm.sampling_params import BeamSearchParams

    request = {"prompt": prompt(), "multi_modal_data": {"image": random_image(56, 56)}}
    with pytest.raises(NotImplementedError, match="beam search"):
        llm.beam_search([request], BeamSearchParams(beam_width=2, max_tokens=2))
    for option in (
        dict(enable_lora=True),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    ):
        with pytest.raises(NotImplementedError, match="vision-language"):
            EngineArgs(model=str(qwen_vl), **option).create_engine_config()
    with pytest.raises(NotImplementedError, match="pooling"):
        LLM(str(qwen_vl), dtype="float32", max_model_len=512, runner="pooling")
    _serves(llm)
