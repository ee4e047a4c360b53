"""A reinforcement-learning loop with pagedlm as the rollout engine (REINFORCE, plain torch).

The trainer holds a Hugging Face copy of the policy; pagedlm samples rollouts; the reward is
the fraction of generated tokens whose id is below --target-below (a toy task the policy can
learn in a few steps). After each optimizer step the trainer pushes every weight to the
engine through vLLM's weight-transfer API, so the next rollouts come from the new policy.

    python examples/rl_rollout_loop.py --model /path/to/hf_model_dir [--backend gloo]

It prints, per step, the mean reward, the committed weight version and the largest gap
between the engine's and the trainer's log-probabilities of the sampled tokens (zero up to
float rounding when the engine serves exactly the trainer's weights, in float32).
"""

from __future__ import annotations

import argparse
import socket
import threading

import torch
from transformers import AutoModelForCausalLM

from pagedlm import LLM, SamplingParams
from pagedlm.distributed.weight_transfer.gloo_engine import GlooWeightTransferEngine
from pagedlm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine


def in_thread(call):
    """Run `call` on a thread (the gloo backend needs both sides at once); join() re-raises."""
    errors: list[BaseException] = []

    def run():
        try:
            call()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join()
        if errors:
            raise errors[0]

    return join


class WeightSync:
    """Trainer side of the weight transfer ("ipc": shared memory; "gloo": broadcast)."""

    def __init__(self, llm: LLM, backend: str) -> None:
        self.llm, self.backend = llm, backend
        if backend == "gloo":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_info = dict(
                master_address="127.0.0.1",
                master_port=port,
                rank_offset=1,
                world_size=1 + llm.get_world_size(),
            )
            join = in_thread(lambda: llm.init_weight_transfer_engine({"init_info": init_info}))
            self.group = GlooWeightTransferEngine.trainer_init(init_info)
            join()
        else:
            llm.init_weight_transfer_engine({"init_info": {}})

    def push(self, model: torch.nn.Module, version: str) -> None:
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        self.llm.start_weight_update()
        if self.backend == "ipc":
            IPCWeightTransferEngine.trainer_send_weights(iter(named), {"llm_handle": self.llm})
        else:
            update_info = {
                "names": [n for n, _ in named],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
            }
            join = in_thread(lambda: self.llm.update_weights({"update_info": update_info}))
            GlooWeightTransferEngine.trainer_send_weights(iter(named), {"group": self.group})
            join()
        self.llm.finish_weight_update(weight_version=version)


def sequence_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's log-probability of each completion token."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--backend", default="ipc", choices=["ipc", "gloo"])
    parser.add_argument("--executor", default="uni", choices=["uni", "mp"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--target-below", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    llm = LLM(
        args.model,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=2**24,
        distributed_executor_backend=args.executor,
        weight_transfer_config={"backend": args.backend},
    )
    sync = WeightSync(llm, args.backend)
    prompts = [[1, 10 + i, 20 + i, 30 + i] for i in range(4)]
    for step in range(1, args.steps + 1):
        params = SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=step, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        samples = [
            (out.prompt_token_ids, list(c.token_ids), c.logprobs)
            for out in outputs
            for c in out.outputs
        ]
        rewards = torch.tensor(
            [sum(t < args.target_below for t in toks) / len(toks) for _, toks, _ in samples]
        )
        advantages = rewards - rewards.mean()
        loss, gap = torch.zeros(()), 0.0
        for (prompt, toks, engine_lps), advantage in zip(samples, advantages, strict=True):
            lps = sequence_logprobs(policy, prompt, toks)
            engine = torch.tensor([d[t].logprob for d, t in zip(engine_lps, toks, strict=True)])
            gap = max(gap, float((lps.detach() - engine).abs().max()))
            loss = loss - advantage * lps.sum() / len(samples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.push(policy, version=f"step-{step}")
        print(
            f"step {step}: mean reward {rewards.mean():.3f}  weight_version "
            f"{llm.get_weight_version()}  engine/trainer logprob gap {gap:.2e}",
            flush=True,
        )
    llm.shutdown_weight_transfer_engine()


if __name__ == "__main__":
    main()
