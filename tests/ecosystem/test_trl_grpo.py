"""TRL's GRPOTrainer with `use_vllm=True, vllm_mode="colocate"`, on pagedlm through the alias.

TRL builds `LLM(..., distributed_executor_backend="external_launcher",
logprobs_mode="processed_logprobs")`, pushes the trainer's weights after every optimizer step
through `llm_engine.model_executor.driver_worker.model_runner.model.load_weights`, and logs how
far the rollout logprobs are from the trainer's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ecosystem.conftest import result_line

pytest.importorskip("trl")

JOB = Path(__file__).with_name("trl_grpo_job.py")


@pytest.mark.slow
def test_trl_grpo_colocate_rollouts_follow_the_trained_weights(
    run_client, tiny_qwen2, tmp_path
) -> None:
    synced = result_line(run_client(JOB, args=(tiny_qwen2, tmp_path / "a", "sync")))
    stale = result_line(run_client(JOB, args=(tiny_qwen2, tmp_path / "b", "nosync")))
    assert len(synced) == len(stale) == 3
    # Every step's rollouts were sampled with the weights the trainer had at that step.
    assert max(synced) < 1e-4, synced
    # The control: without TRL's weight push, steps 2 and 3 sample from the stale weights.
    assert stale[0] < 1e-4 and min(stale[1:]) > 0.1, stale
