"""Incremental weight loading: the vLLM attribute chain, prefix-cache invalidation, fused and
tensor-parallel targets, bad input leaving the old weights serving, in-flight requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedlm import LLM, SamplingParams
from tests.rl.test_weight_transfer import ENGINE, Pusher

LONG_PROMPT = {"prompt_token_ids": list(range(20, 60))}  # 40 tokens: two full 16-token blocks
GREEDY = SamplingParams(max_tokens=5, temperature=0, logprobs=2)


def perturbed_checkpoint(src: Path, dst: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy of the model at `src` with noisy weights; returns its state dict."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    state = {n: t + 0.2 * torch.randn(t.shape, generator=gen) for n, t in state.items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return state


def run(llm: LLM, prompt=LONG_PROMPT):
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)]


def assert_close(got, want) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def test_attribute_chain_loads_one_tensor_a_call_and_invalidates_prefix_cache(tiny_qwen2, tmp_path):
    new_state = perturbed_checkpoint(tiny_qwen2, tmp_path / "new")
    want = run(LLM(str(tmp_path / "new"), **ENGINE))
    llm = LLM(str(tiny_qwen2), **ENGINE)
    old = run(llm)  # fills the prefix cache with the old weights' KV
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, tensor in new_state.items():  # q/k/v and gate/up land in fused parameters
        model.load_weights([(name, tensor)])
    got = run(llm)
    assert got[0] != old[0] or got[1] != pytest.approx(old[1], abs=1e-3)
    assert_close(got, want)
    stats = llm.llm_engine.kv_cache_manager.prefix_cache_stats
    assert stats.hits == 0


def test_partial_update_changes_only_what_is_given(tiny_qwen2, tmp_path):
    """One fused shard (k_proj of layer 1) alone: the other shards keep their values."""
    new_state = perturbed_checkpoint(tiny_qwen2, tmp_path / "new")
    mixed = load_file(str(tiny_qwen2 / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    mixed[name] = new_state[name]
    shutil.copytree(tiny_qwen2, tmp_path / "mixed")
    save_file(mixed, str(tmp_path / "mixed" / "model.safetensors"), metadata={"format": "pt"})
    want = run(LLM(str(tmp_path / "mixed"), **ENGINE))
    llm = LLM(str(tiny_qwen2), **ENGINE)
    llm.apply_model(lambda m: m.load_weights([(name, new_state[name])]))
    assert_close(run(llm), want)


def test_bad_updates_raise_and_keep_old_weights(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), weight_transfer_config={"backend": "ipc"}, **ENGINE)
    before = run(llm)
    pusher = Pusher(llm, "ipc", world_size=1)
    good = ("model.norm.weight", torch.full((64,), 3.0))
    bad_updates = {
        "matches no parameter": [good, ("model.layers.9.mlp.up_proj.weight", torch.ones(128, 64))],
        "has shape": [good, ("model.layers.0.self_attn.q_proj.weight", torch.ones(64, 63))],
        "not a floating-point": [good, ("model.norm.weight", torch.ones(64, dtype=torch.int64))],
    }
    for message, named in bad_updates.items():
        with pytest.raises(ValueError, match=message):
            pusher.push(named, version="bad")
        llm.finish_weight_update()  # the failed push left the update open
        assert run(llm) == before
    with pytest.raises(RuntimeError, match="outside a weight update"):
        llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    with pytest.raises(RuntimeError, match="without a matching start"):
        llm.finish_weight_update()
    with pytest.raises(ValueError, match="dtype name"):
        llm.start_weight_update()
        llm.update_weights(
            {"update_info": {"names": ["x"], "dtype_names": ["int8x"], "shapes": [[1]]}}
        )
    llm.finish_weight_update()
    assert llm.get_weight_version() is None
    assert run(llm) == before


def test_no_transfer_backend_configured(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), **ENGINE)
    with pytest.raises(ValueError, match="weight_transfer_config"):
        llm.init_weight_transfer_engine({"init_info": {}})
    with pytest.raises(ValueError, match="gloo"):
        LLM(str(tiny_qwen2), weight_transfer_config={"backend": "nccl"}, **ENGINE)


@pytest.mark.parametrize("backend", ["ipc", "gloo"])
def test_tensor_parallel_ranks_load_their_shards(tiny_qwen2, tmp_path, backend):
    new_state = perturbed_checkpoint(tiny_qwen2, tmp_path / "new")
    want = run(LLM(str(tmp_path / "new"), **ENGINE))
    llm = LLM(
        str(tiny_qwen2),
        tensor_parallel_size=2,
        weight_transfer_config={"backend": backend},
        **ENGINE,
    )
    try:
        run(llm)  # fills the prefix cache with the old weights' KV
        Pusher(llm, backend, world_size=2).push(list(new_state.items()), version="v1")
        assert_close(run(llm), want)
        # the worker processes said with their replies that the weights changed
        assert llm.llm_engine.kv_cache_manager.prefix_cache_stats.hits == 0
    finally:
        llm.llm_engine.shutdown()


def test_in_flight_requests_with_sleep_keep(tiny_qwen2, tmp_path):
    """sleep(level=0, mode="keep") pauses requests mid-generation; they resume after the
    weights change (KV kept: earlier tokens' KV is from the old weights) and finish."""
    new_state = perturbed_checkpoint(tiny_qwen2, tmp_path / "new")
    want = run(LLM(str(tmp_path / "new"), **ENGINE))
    llm = LLM(str(tiny_qwen2), weight_transfer_config={"backend": "ipc"}, **ENGINE)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.enqueue([LONG_PROMPT, {"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    for _ in range(3):  # prefill and a couple of decode steps with the old weights
        llm.llm_engine.step()
    llm.sleep(level=0, mode="keep")
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate([LONG_PROMPT], GREEDY, use_tqdm=False)
    Pusher(llm, "ipc", world_size=1).push(list(new_state.items()), version="v2")
    assert llm.wake_up() is True
    finished = llm.wait_for_completion(use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in finished] == [12, 12]
    assert llm.get_weight_version() == "v2"
    assert_close(run(llm), want)  # a new request never reuses the old weights' KV


def test_ipc_handles_in_process_tensors_and_bad_handles(tiny_qwen2, tmp_path):
    """The ipc backend also takes the tensors themselves (trainer in the engine's process);
    a handle that does not match its declared dtype/shape, or runs past its shared-memory
    file, is refused before anything is loaded."""
    from pagedlm.distributed.weight_transfer.ipc_engine import pack_shared

    new_state = perturbed_checkpoint(tiny_qwen2, tmp_path / "new")
    want = run(LLM(str(tmp_path / "new"), **ENGINE))
    llm = LLM(str(tiny_qwen2), weight_transfer_config={"backend": "ipc"}, **ENGINE)
    before = run(llm)
    llm.init_weight_transfer_engine({"init_info": {}})
    names = list(new_state)
    info = {
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(new_state[n].shape) for n in names],
    }
    llm.start_weight_update()
    wrong = dict(info, ipc_handles=[new_state[n].double() for n in names])
    with pytest.raises(ValueError, match="declares"):
        llm.update_weights({"update_info": wrong})
    packed, path = pack_shared([(names[0], new_state[names[0]])])
    try:
        too_long = {
            "names": [names[0]],
            "dtype_names": ["float32"],
            "shapes": [[packed.shapes[0][0] * 2, *packed.shapes[0][1:]]],
            "ipc_handles": packed.ipc_handles,
        }
        with pytest.raises(ValueError, match="run past the end"):
            llm.update_weights({"update_info": too_long})
    finally:
        Path(path).unlink()
    assert run(llm) == before
    llm.update_weights({"update_info": dict(info, ipc_handles=[new_state[n] for n in names])})
    llm.finish_weight_update(weight_version="in-process")
    assert_close(run(llm), want)


def test_partial_update_in_bf16_through_repacked_weights(tiny_qwen2, tmp_path):
    """bf16 weights live in compute layouts after loading (oneDNN prepacked; without AMX the
    small-batch kernel's blocked copy): an update restores the dense weight from them first."""
    new_state = perturbed_checkpoint(tiny_qwen2, tmp_path / "new")
    mixed = load_file(str(tiny_qwen2 / "model.safetensors"))
    names = ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    for name in names:
        mixed[name] = new_state[name]
    shutil.copytree(tiny_qwen2, tmp_path / "mixed")
    save_file(mixed, str(tmp_path / "mixed" / "model.safetensors"), metadata={"format": "pt"})
    bf16 = dict(ENGINE, dtype="bfloat16")
    want = run(LLM(str(tmp_path / "mixed"), **bf16))
    llm = LLM(str(tiny_qwen2), **bf16)
    llm.apply_model(lambda m: m.load_weights([(n, new_state[n]) for n in names]))
    assert_close(run(llm), want)


def test_quantized_layers_refuse_updates(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), **dict(ENGINE, quantization="int8"))
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="held quantized in this engine \\(Int8LinearMethod"):
        llm.apply_model(lambda m: m.load_weights([(name, torch.zeros(64, 64))]))


def test_tied_embeddings_update_the_lm_head_too(tiny_model_factory, tmp_path):
    """With tie_word_embeddings the LM head reads the embedding (plus a prepacked copy): an
    update of model.embed_tokens.weight must reach both; level-2 sleep + reload keeps them tied."""
    tied = tiny_model_factory("qwen2", tie_word_embeddings=True)
    new_state = perturbed_checkpoint(tied, tmp_path / "new")
    name = "model.embed_tokens.weight"
    mixed = load_file(str(tied / "model.safetensors"))
    mixed[name] = new_state[name]
    shutil.copytree(tied, tmp_path / "mixed")
    save_file(mixed, str(tmp_path / "mixed" / "model.safetensors"), metadata={"format": "pt"})
    want = run(LLM(str(tmp_path / "mixed"), **ENGINE))
    llm = LLM(str(tied), enable_sleep_mode=True, **ENGINE)
    before = run(llm)
    llm.apply_model(lambda m: m.load_weights([(name, new_state[name])]))
    assert_close(run(llm), want)
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    assert run(llm) == before
