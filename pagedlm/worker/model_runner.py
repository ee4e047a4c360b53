"""ModelRunner: owns the model, the KV cache tensors and the sampler; runs one step.

Logits are computed only for rows that are sampled, and for prompt rows of requests that
asked for prompt logprobs.
"""

from __future__ import annotations

import logging

import torch

from pagedlm.attention.backend import get_attn_backend
from pagedlm.attention.kv_cache_dtype import kv_cache_torch_dtype
from pagedlm.config import VllmConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedlm.forward_context import set_forward_context
from pagedlm.layers.attention import Attention
from pagedlm.layers.sampler import Sampler, gather_logprobs
from pagedlm.model_loader.loader import get_model
from pagedlm.platforms import current_platform
from pagedlm.worker.input_batch import StepInputs, build_step_inputs
from pagedlm.worker.sampling_metadata import build_sampling_metadata

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_CHUNK = 256  # rows of [chunk, vocab] fp32 logits at a time


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = current_platform.device
        current_platform.setup_threads()
        self.model = get_model(self.model_config, self.device)
        self.attn_layers = [
            m for m in self.model.modules() if isinstance(m, Attention) and m.attn_type == "decoder"
        ]
        self.attn_backend = get_attn_backend(self.device)
        Attention.backend = self.attn_backend
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []

    # ---------------------------------------------------------------- KV cache
    def _kv_cache_dtype(self) -> torch.dtype:
        kv_cache_dtype = self.vllm_config.cache_config.kv_cache_dtype
        return kv_cache_torch_dtype(kv_cache_dtype, self.model_config.dtype)

    def get_kv_cache_bytes_per_block(self, block_size: int) -> int:
        itemsize = self._kv_cache_dtype().itemsize
        return sum(
            2 * block_size * layer.num_kv_heads * layer.head_size * itemsize
            for layer in self.attn_layers
        )

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One zeroed [2, num_blocks, block_size, kv_heads, head_size] tensor per layer.

        Zeroed (not empty) because padded attention reads unwritten slots under a mask, and
        0 * NaN would poison the output; pages are mapped lazily, as blocks are first used.
        """
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            cache = current_platform.zeros_lazy(shape, self._kv_cache_dtype())
            layer.kv_cache = cache
            layer.calculate_kv_scales = self.vllm_config.cache_config.calculate_kv_scales
            self.kv_caches.append(cache)

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager
    ) -> ModelRunnerOutput:
        inputs = build_step_inputs(scheduler_output, kv_cache_manager)
        device = self.device
        input_ids = torch.from_numpy(inputs.input_ids).to(device)
        positions = torch.from_numpy(inputs.positions).to(device)
        attn_metadata = self.attn_backend.build(inputs.attn, device)
        kwargs = {}
        if getattr(self.model, "accepts_token_type_ids", False):
            if inputs.token_type_ids is not None:
                kwargs["token_type_ids"] = torch.from_numpy(inputs.token_type_ids).to(device)
        with set_forward_context(attn_metadata):
            hidden_states = self.model(input_ids, positions, **kwargs)

        output = ModelRunnerOutput()
        self._prompt_logprobs(inputs, hidden_states, output)
        self._pool(inputs, hidden_states, output)
        if not inputs.sampling_requests:
            return output
        logits_indices = torch.from_numpy(inputs.logits_indices).to(device)
        logits = self.model.compute_logits(hidden_states[logits_indices])
        metadata = build_sampling_metadata(
            inputs.sampling_requests,
            self.model_config.vocab_size,
            device,
            self.model_config.logprobs_mode,
        )
        sampler_output = self.sampler(logits, metadata)
        sampled = sampler_output.sampled_token_ids.tolist()
        lists = sampler_output.logprobs
        for i, request in enumerate(inputs.sampling_requests):
            rid = request.request_id
            output.sampled_token_ids[rid] = [sampled[i]]
            params = request.sampling_params
            if lists is not None and params is not None and params.logprobs is not None:
                k = params.logprobs if params.logprobs != -1 else self.model_config.vocab_size
                output.logprobs[rid] = LogprobsLists(
                    [lists.logprob_token_ids[i][: k + 1]],
                    [lists.logprobs[i][: k + 1]],
                    [lists.sampled_token_ranks[i]],
                )
        return output

    def _pool(self, inputs: StepInputs, hidden_states: torch.Tensor, output: ModelRunnerOutput):
        """Pooling requests are computed whole in one step: pool all their rows."""
        for request in inputs.requests:
            if request.pooling_params is None:
                continue
            start, num_rows, position = inputs.query_starts[request.request_id]
            assert position == 0 and num_rows == request.num_tokens, "pooling needs whole prompts"
            rows = hidden_states[start : start + num_rows]
            output.pooler_output[request.request_id] = (
                self.model.pooler(rows, request.pooling_params).float().cpu()
            )

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden_states: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """Logprobs of prompt tokens 1..P-1 computed in this step's chunk of each request."""
        for request in inputs.requests:
            params = request.sampling_params
            if params is None or params.prompt_logprobs is None:
                continue
            row_start, num_rows, position = inputs.query_starts[request.request_id]
            # a row at position p predicts prompt token p + 1
            num_rows = min(num_rows, request.num_prompt_tokens - 1 - position)
            if num_rows <= 0:
                continue
            k = params.prompt_logprobs
            targets = torch.tensor(
                request.prompt_token_ids[position + 1 : position + 1 + num_rows],
                device=hidden_states.device,
            )
            merged = LogprobsLists([], [], [])
            for s in range(0, num_rows, _PROMPT_LOGPROBS_CHUNK):
                e = min(num_rows, s + _PROMPT_LOGPROBS_CHUNK)
                logits = self.model.compute_logits(hidden_states[row_start + s : row_start + e])
                logprobs = logits.float().log_softmax(-1)
                part = gather_logprobs(logprobs, k, targets[s:e])
                merged.logprob_token_ids += part.logprob_token_ids
                merged.logprobs += part.logprobs
                merged.sampled_token_ranks += part.sampled_token_ranks
            output.prompt_logprobs[request.request_id] = merged
