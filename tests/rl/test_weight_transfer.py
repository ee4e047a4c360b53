"""RL weight transfer end to end: a plain-torch trainer pushes its weights after every
optimizer step (ipc and gloo backends, in-process and multiprocess executors); the engine's
greedy outputs and logprobs then equal a fresh LLM loaded from the trainer's checkpoint."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.distributed.weight_transfer.gloo_engine import GlooWeightTransferEngine
from pagedlm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

PROMPTS = [[5, 17, 33, 90, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2)
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**21, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trainer(model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, torch.optim.Adam(model.parameters(), lr=3e-2)


def train_step(model, optimizer, step: int) -> float:
    gen = torch.Generator().manual_seed(step)
    batch = torch.randint(3, 500, (4, 12), generator=gen)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def save_checkpoint(model, src_dir: Path, dst: Path) -> Path:
    model.save_pretrained(dst, safe_serialization=True)
    for f in src_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, dst / f.name)
    return dst


def outputs(llm: LLM):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lp_g.keys() == lp_w.keys()
            for tok in lp_g:
                assert lp_g[tok].logprob == pytest.approx(lp_w[tok].logprob, abs=1e-4)
        for lp_g, lp_w in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            for tok in lp_w:
                assert lp_g[tok].logprob == pytest.approx(lp_w[tok].logprob, abs=1e-4)


class Pusher:
    """The trainer's side of one backend."""

    def __init__(self, llm: LLM, backend: str, world_size: int) -> None:
        self.llm, self.backend = llm, backend
        if backend == "gloo":
            init_info = dict(
                master_address="127.0.0.1",
                master_port=free_port(),
                rank_offset=1,
                world_size=1 + world_size,
            )
            self.group = self._concurrently(
                lambda: llm.init_weight_transfer_engine({"init_info": init_info}),
                lambda: GlooWeightTransferEngine.trainer_init(init_info),
            )
        else:
            llm.init_weight_transfer_engine({"init_info": {}})

    @staticmethod
    def _concurrently(engine_call, trainer_call):
        errors: list[BaseException] = []

        def run():
            try:
                engine_call()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        result = trainer_call()
        thread.join()
        if errors:
            raise errors[0]
        return result

    def push(self, named: list[tuple[str, torch.Tensor]], version: str) -> None:
        self.llm.start_weight_update()
        if self.backend == "ipc":
            IPCWeightTransferEngine.trainer_send_weights(iter(named), {"llm_handle": self.llm})
        else:
            info = {
                "names": [n for n, _ in named],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
            }
            self._concurrently(
                lambda: self.llm.update_weights({"update_info": info}),
                lambda: GlooWeightTransferEngine.trainer_send_weights(
                    iter(named), {"group": self.group}
                ),
            )
        self.llm.finish_weight_update(weight_version=version)


@pytest.mark.parametrize(
    "backend,executor", [("ipc", "uni"), ("gloo", "uni"), ("ipc", "mp"), ("gloo", "mp")]
)
def test_training_loop_pushes_weights(tiny_qwen2, tmp_path, backend, executor):
    model, optimizer = make_trainer(tiny_qwen2)
    llm = LLM(
        str(tiny_qwen2),
        distributed_executor_backend=executor,
        weight_transfer_config={"backend": backend},
        **ENGINE,
    )
    try:
        pusher = Pusher(llm, backend, world_size=1)
        assert llm.get_weight_version() is None
        before = outputs(llm)
        for step in range(1, 4):
            train_step(model, optimizer, step)
            named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
            pusher.push(named, version=f"step-{step}")
            assert llm.get_weight_version() == f"step-{step}"
            got = outputs(llm)
            ckpt = save_checkpoint(model, tiny_qwen2, tmp_path / f"step{step}")
            fresh = LLM(str(ckpt), **ENGINE)
            assert_same(got, outputs(fresh))
            del fresh
        assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in before]
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.llm_engine.shutdown()
