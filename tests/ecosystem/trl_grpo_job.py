"""TRL GRPO in vLLM colocate mode, unchanged TRL code, with pagedlm as the rollout engine.

    python trl_grpo_job.py MODEL OUTDIR sync|nosync

trains 3 steps on CPU (learning rate high enough to move the weights) and prints
`RESULT [...]`: TRL's per-step `sampling/sampling_logp_difference/max`, the largest gap between
the logprobs pagedlm sampled with and the trainer's own logprobs of the same tokens. `nosync`
turns TRL's weight push off (the negative control).
"""

import json
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model, out, nosync = sys.argv[1], sys.argv[2], sys.argv[3] == "nosync"
ds = Dataset.from_list([{"prompt": f"Hello, my name is {n}"} for n in "ABCDEFGHIJKL"])


def reward_distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


args = GRPOConfig(
    output_dir=out,
    use_cpu=True,
    max_steps=3,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    use_vllm=True,
    vllm_mode="colocate",
    learning_rate=0.05,
    report_to=[],
    logging_steps=1,
    bf16=False,
    save_strategy="no",
    vllm_max_model_length=64,
    seed=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=reward_distinct_chars, args=args, train_dataset=ds)
if nosync:
    trainer.vllm_generation.sync_weights = lambda *a, **k: None
trainer.train()
hist = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
print("RESULT " + json.dumps([h["sampling/sampling_logp_difference/max"] for h in hist]))
