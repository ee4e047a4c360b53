"""Scheduling prompts with images: after every step, each placeholder token the step computes
has its image's encoder output on the (simulated) worker, the worker holds everything the
encoder cache manager believes cached, and outputs equal the reference whatever the budget,
chunking, caching or preemption."""

from __future__ import annotations

import pytest

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.encoder_cache_manager import EncoderCacheManager
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request
from pagedlm.core.scheduler import Scheduler
from pagedlm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedlm.sampling_params import SamplingParams
from tests.unit.test_scheduler import fake_runner, reference_outputs

IMAGE_TOKEN = 9


def image_request(request_id: str, layout: list[tuple[int, str]], block_size: int = 4) -> Request:
    """`layout`: (number of text tokens, "") or (number of image tokens, image id) runs."""
    tokens: list[int] = []
    features = []
    for n, image in layout:
        if image:
            features.append(
                MultiModalFeatureSpec("image", image, PlaceholderRange(len(tokens), n), {})
            )
            tokens += [IMAGE_TOKEN] * n
        else:
            tokens += [(len(tokens) * 7 + int(request_id[-1])) % 50 + 10 for _ in range(n)]
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=3, ignore_eos=True),
        max_tokens=3,
        block_size=block_size,
        mm_features=features,
    )


def make(budget=4096, blocks=64, block_size=4, whole=False, caching=True) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=128,
        disable_chunked_mm_input=whole,
    )
    kv = KVCacheManager(blocks, block_size, caching)
    return Scheduler(config, CacheConfig(block_size=block_size), kv)


def run(sched: Scheduler, requests: list[Request]) -> tuple[dict[str, list[int]], int]:
    """Run to completion, checking the worker's encoder cache each step; returns the outputs
    and how many images were encoded."""
    for r in requests:
        sched.add_request(r)
    worker: set[str] = set()
    by_id = {r.request_id: r for r in requests}
    outputs: dict[str, list[int]] = {}
    encoded = 0
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        worker -= set(so.free_encoder_mm_hashes)
        for rid, indices in so.scheduled_encoder_inputs.items():
            for i in indices:
                worker.add(by_id[rid].mm_features[i].identifier)
                encoded += 1
        for rid in so.scheduled_req_ids:
            start = so.num_computed_tokens[rid]
            end = start + so.num_scheduled_tokens[rid]
            for f in by_id[rid].mm_features:
                if f.mm_position.overlaps(start, end):
                    assert f.identifier in worker, (rid, f.identifier)
                    if sched.config.disable_chunked_mm_input:
                        assert f.mm_position.end <= end, "an image was cut"
        for out in sched.update_from_output(so, fake_runner(sched, so)):
            if out.finished:
                outputs[out.request_id] = list(by_id[out.request_id].output_token_ids)
        sched.check_invariants()
        assert set(sched.encoder_cache_manager.cached) <= worker
    assert not sched.has_unfinished_requests()
    return outputs, encoded


def requests(block_size: int = 4) -> list[Request]:
    return [
        image_request("r0", [(3, ""), (10, "A"), (5, "")], block_size),
        image_request("r1", [(3, ""), (10, "A"), (2, ""), (6, "B"), (1, "")], block_size),
        image_request("r2", [(9, "")], block_size),
        image_request("r3", [(2, ""), (12, "C"), (4, "")], block_size),
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(budget=5),  # chunks cut inside images
        dict(budget=16, whole=True),  # images never cut
        dict(blocks=9),  # preemption
        dict(caching=False),
    ],
    ids=["plain", "tiny-budget", "whole-images", "preemption", "no-prefix-cache"],
)
def test_outputs_and_encoder_cache_invariants(kwargs) -> None:
    reqs = requests()
    expected = reference_outputs(reqs)
    outputs, _ = run(make(**kwargs), reqs)
    assert outputs == expected


def test_same_image_is_encoded_once() -> None:
    _, encoded = run(make(), requests())
    assert encoded == 3  # A (shared by r0 and r1), B, C


def test_images_change_block_hashes() -> None:
    a = image_request("r0", [(4, ""), (8, "A")])
    b = image_request("r0", [(4, ""), (8, "B")])
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.block_hashes[0] == b.block_hashes[0]  # text only
    assert a.block_hashes[1] != b.block_hashes[1] and a.block_hashes[2] != b.block_hashes[2]


def test_freeable_entries_are_evicted_oldest_first() -> None:
    manager = EncoderCacheManager(cache_size=20)
    r0 = image_request("r0", [(10, "A")])
    r1 = image_request("r1", [(10, "B")])
    r2 = image_request("r2", [(10, "C")])
    for r in (r0, r1):
        assert not manager.check_and_update_cache(r, 0)
        assert manager.can_allocate(r, 0, 0)
        manager.allocate(r, 0)
    assert not manager.can_allocate(r2, 0, 0)  # both in use
    manager.free(r0)
    manager.free(r1)
    assert manager.can_allocate(r2, 0, 0)
    assert manager.get_freed_mm_hashes() == ["A"]
    manager.check_invariants()
