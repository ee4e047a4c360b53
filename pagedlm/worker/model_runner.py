"""ModelRunner: owns the model (this rank's shard), the KV cache tensors, the persistent batch
and the sampler; applies each SchedulerOutput diff to its batch and runs one step.

Logits are computed only for rows that are sampled, and for prompt rows of requests that
asked for prompt logprobs; the model's last layer computes only those rows (and pooled ones)
from its attention's queries on, while every token's key and value reach the cache. Under
tensor parallelism every rank runs the same forward and the same `compute_logits` calls (they
are collectives); only the first rank gets whole logits, samples and pools, and its output is
the step's output.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from pagedlm import envs
from pagedlm.attention.backend import get_attn_backend
from pagedlm.attention.kv_cache_dtype import kv_cache_torch_dtype
from pagedlm.config import VllmConfig
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.distributed import get_tp_group
from pagedlm.exceptions import blame_request
from pagedlm.forward_context import set_forward_context
from pagedlm.layers.attention import (
    Attention,
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    paged_attention_layers,
)
from pagedlm.layers.sampler import Sampler, gather_logprobs
from pagedlm.lora.layers import activate as activate_lora
from pagedlm.lora.manager import WorkerLoRAManager
from pagedlm.model_loader.loader import get_model
from pagedlm.models.llama_decode_plan import DecodeBuffers, LlamaDecodePlan
from pagedlm.runner_outputs import LogprobsLists, ModelRunnerOutput
from pagedlm.spec_decode.draft_model import DraftModelProposer
from pagedlm.spec_decode.ngram_proposer import NgramProposer, can_speculate
from pagedlm.spec_decode.rejection_sampler import verify_greedy, verify_random
from pagedlm.structured_output.bitmask import grammar_rows
from pagedlm.utils import cdiv
from pagedlm.worker.input_batch import CachedRequestState, InputBatch
from pagedlm.worker.lora_model_runner_mixin import lora_step_mapping
from pagedlm.worker.mm_runner import MultiModalRunner
from pagedlm.worker.sampling_metadata import build_sampling_metadata
from pagedlm.worker.step_inputs import StepInputs, build_step_inputs

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_CHUNK = 256  # rows of [chunk, vocab] fp32 logits at a time


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.is_driver = get_tp_group().is_first_rank
        self.model = get_model(self.model_config, self.device)
        self.attn_layers = paged_attention_layers(self.model)
        self.attn_backend = get_attn_backend(self.device)
        Attention.backend = self.attn_backend
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = vllm_config.cache_config.block_size
        self.input_batch = self._new_input_batch()
        spec = vllm_config.speculative_config
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if spec is not None and spec.method == "draft_model":
            self.proposer = DraftModelProposer(vllm_config, device)
        elif spec is not None:
            self.proposer = NgramProposer(spec)
        self._plan_rows: int | None = None  # decided once the KV cache exists; 0: no plans
        self._plan_buffers: DecodeBuffers | None = None
        self._decode_plans: dict[int, LlamaDecodePlan] = {}  # by number of sequences
        self.lora_manager: WorkerLoRAManager | None = None
        if vllm_config.lora_config is not None:
            self.lora_manager = WorkerLoRAManager(
                self.model, vllm_config.lora_config, self.model_config.dtype, device
            )
        # the last layer computes only the rows a step uses (step_inputs.py)
        self._select_outputs = self.model.supports_output_rows
        pooler = self.model.pooler if self.model.is_pooling_model else None
        self._pool_last_row = pooler is not None and pooler.pooling_type == "LAST"
        self.mm_runner: MultiModalRunner | None = None  # images (vision-language models)
        if self.model.mm_processor_cls is not None:
            self.mm_runner = MultiModalRunner(self.model)

    def _new_input_batch(self) -> InputBatch:
        max_len = self.model_config.max_model_len
        return InputBatch(
            max_num_reqs=self.vllm_config.scheduler_config.max_num_seqs,
            max_model_len=max_len,
            max_num_blocks_per_req=cdiv(max_len, self.block_size),
            vocab_size=self.model_config.vocab_size,
        )

    # ---------------------------------------------------------------- KV cache
    def kv_cache_dtype(self) -> torch.dtype:
        kv_cache_dtype = self.vllm_config.cache_config.kv_cache_dtype
        return kv_cache_torch_dtype(kv_cache_dtype, self.model_config.dtype)

    def get_kv_cache_bytes_per_block(self, block_size: int) -> int:
        layers = self.attn_layers
        if isinstance(self.proposer, DraftModelProposer):  # its KV lives in the same blocks
            layers = layers + self.proposer.attn_layers
        return kv_cache_bytes_per_block(layers, block_size, self.kv_cache_dtype())

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The layers' paged KV caches (`allocate_kv_caches`), the draft model's too."""
        self.block_size = block_size
        self.input_batch = self._new_input_batch()
        for layer in self.attn_layers:
            layer.calculate_kv_scales = self.vllm_config.cache_config.calculate_kv_scales
        self.allocate_kv_caches(num_blocks)

    def allocate_kv_caches(self, num_blocks: int) -> None:
        """The layers' caches of `num_blocks` blocks (zeroed, pages mapped when first used)."""
        dtype, block_size = self.kv_cache_dtype(), self.block_size
        self.kv_caches = allocate_kv_caches(self.attn_layers, num_blocks, block_size, dtype)
        if isinstance(self.proposer, DraftModelProposer):
            allocate_kv_caches(self.proposer.attn_layers, num_blocks, block_size, dtype)
        self._plan_rows = None

    def free_kv_caches(self) -> None:
        """Drop every reference to the KV caches: the layers' (the draft model's too) and the
        decode plans', which hold the caches and weights they were built for; sleep frees
        that memory only once no plan is left."""
        layers = self.attn_layers
        if isinstance(self.proposer, DraftModelProposer):
            layers = layers + self.proposer.attn_layers
        for layer in layers:
            layer.kv_cache = None
        self.kv_caches = []
        self._plan_rows, self._plan_buffers, self._decode_plans = None, None, {}

    def reset_requests(self) -> None:
        """Forget the batch after a failed step: the scheduler sends every request again whole."""
        self.input_batch.reset_rows()
        if self.mm_runner is not None:
            self.mm_runner.reset()
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.draft_probs.clear()

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.input_batch.apply(scheduler_output)
        if self.mm_runner is not None:
            for new in scheduler_output.scheduled_new_reqs:
                self.mm_runner.add_request_state(self.input_batch.requests[new.req_id])
            self.mm_runner.run_encoders(scheduler_output, self.input_batch)
        output = ModelRunnerOutput()
        if not scheduler_output.scheduled_req_ids:
            return output
        inputs = build_step_inputs(
            self.input_batch,
            scheduler_output,
            self.block_size,
            self._select_outputs,
            self._pool_last_row,
        )
        device = self.device
        input_ids = torch.from_numpy(inputs.input_ids).to(device)
        positions = torch.from_numpy(inputs.positions).to(device)
        kwargs = {}
        if self.model.accepts_token_type_ids:
            if inputs.token_type_ids is not None:
                kwargs["token_type_ids"] = torch.from_numpy(inputs.token_type_ids).to(device)
        if self.mm_runner is not None:
            if self.model.uses_mrope:
                positions = torch.from_numpy(self.mm_runner.mrope_positions(inputs)).to(device)
            if self.mm_runner.has_mm_tokens(inputs):
                kwargs["inputs_embeds"] = self.mm_runner.inputs_embeds(inputs, input_ids)
                if self.model.mm_bidirectional:
                    inputs.attn.bidirectional_spans = self.mm_runner.bidirectional_spans(inputs)
        attn_metadata = self.attn_backend.build(inputs.attn, device)
        lora: AbstractContextManager = nullcontext()  # a step without adapters: the base path
        if self.lora_manager is not None:
            mapping = lora_step_mapping(self.lora_manager, self.input_batch, inputs)
            if mapping is not None:
                lora = activate_lora(self.lora_manager.layers, mapping)
        plan = None
        if (
            not kwargs
            and isinstance(lora, nullcontext)
            and self.proposer is None
            and positions.dim() == 1
        ):
            plan = self._decode_plan(input_ids.shape[0], attn_metadata)
        output_rows = None
        if inputs.output_rows is not None:
            output_rows = torch.from_numpy(inputs.output_rows).to(device)
        if plan is not None:  # every query one row: no output rows selected (step_inputs.py)
            hidden_states = plan.run(input_ids, positions, attn_metadata)
        else:
            if output_rows is not None:
                kwargs["output_rows"] = output_rows
            with set_forward_context(attn_metadata), lora:
                hidden_states = self.model(input_ids, positions, **kwargs)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.prefill(input_ids, positions, attn_metadata, output_rows)

        self._prompt_logprobs(inputs, hidden_states, output)
        if self.is_driver:
            self._pool(inputs, hidden_states, output)
        if not inputs.sampling_states:
            return output
        logits_indices = torch.from_numpy(inputs.logits_indices).to(device)
        logits = self.model.compute_logits(hidden_states[logits_indices])
        if logits is None:  # not the first tensor-parallel rank
            return output
        if (inputs.num_logits > 1).any():
            self._sample_with_drafts(inputs, logits, scheduler_output, output)
        else:
            self._sample(inputs, logits, output, scheduler_output)
        if self.proposer is not None:
            self._propose(inputs, output)
        return output

    def _decode_plan(self, num_tokens: int, attn_metadata) -> LlamaDecodePlan | None:
        """The prepared kernel calls for a decode-only step of up to MAX_ROWS sequences, where
        the model supports them (models/llama_decode_plan.py); None: run the modules."""
        if self._plan_rows is None:
            supported = not envs.PAGEDLM_DISABLE_DECODE_PLAN and LlamaDecodePlan.supports(
                self.model.text_model
            )
            self._plan_rows = LlamaDecodePlan.max_rows(self.model.text_model) if supported else 0
            self._plan_buffers, self._decode_plans = None, {}
        decode_only = getattr(attn_metadata, "num_decode_tokens", -1) == num_tokens
        if not (decode_only and num_tokens <= self._plan_rows):
            return None
        plan = self._decode_plans.get(num_tokens)
        if plan is None or not plan.current():
            if self._plan_buffers is None:
                max_blocks = cdiv(self.model_config.max_model_len, self.block_size)
                text_model = self.model.text_model
                self._plan_buffers = DecodeBuffers(text_model, self._plan_rows, max_blocks)
            plan = LlamaDecodePlan(self.model.text_model, num_tokens, self._plan_buffers)
            self._decode_plans[num_tokens] = plan
        return plan

    def _sample(
        self,
        inputs: StepInputs,
        logits: torch.Tensor,
        output: ModelRunnerOutput,
        scheduler_output: SchedulerOutput,
    ) -> None:
        metadata = build_sampling_metadata(
            self.input_batch,
            inputs.sampling_rows,
            inputs.sampling_states,
            self.device,
            self.model_config.logprobs_mode,
        )
        grammar = grammar_rows(  # structured outputs
            scheduler_output.grammar_output, [s.req_id for s in inputs.sampling_states]
        )
        if grammar is not None:
            metadata.grammar_rows, metadata.grammar_bitmask = grammar
        metadata.return_sampling_mask = self.model_config.return_sampling_mask
        sampler_output = self.sampler(logits, metadata)
        sampled = sampler_output.sampled_token_ids.tolist()
        lists = sampler_output.logprobs
        for i, state in enumerate(inputs.sampling_states):
            output.sampled_token_ids[state.req_id] = [sampled[i]]
            if sampler_output.sampling_mask is not None:
                output.sampling_mask[state.req_id] = [sampler_output.sampling_mask[i]]
            k = self._num_logprobs(state)
            if lists is not None and k is not None:
                output.logprobs[state.req_id] = LogprobsLists(
                    [lists.logprob_token_ids[i][: k + 1]],
                    [lists.logprobs[i][: k + 1]],
                    [lists.sampled_token_ranks[i]],
                )

    def _num_logprobs(self, state: CachedRequestState) -> int | None:
        params = state.sampling_params
        return None if params is None else params.num_logprobs  # logprob_token_ids count too

    def _sample_with_drafts(
        self,
        inputs: StepInputs,
        logits: torch.Tensor,  # [num_logits.sum(), vocab]: each request's rows in a run
        so: SchedulerOutput,
        output: ModelRunnerOutput,
    ) -> None:
        """Requests with drafts keep the accepted ones plus one target token (rejection
        sampling); the others sample as usual. Each row is sampled with its request's params."""
        counts = inputs.num_logits
        states = [
            s
            for s, c in zip(inputs.sampling_states, counts.tolist(), strict=True)
            for _ in range(c)
        ]
        rows = np.repeat(inputs.sampling_rows, counts)
        mode = self.model_config.logprobs_mode
        metadata = build_sampling_metadata(self.input_batch, rows, states, self.device, mode)
        grammar = grammar_rows(so.grammar_output, [s.req_id for s in states])
        if grammar is not None:  # grammar requests get no drafts: one row each
            metadata.grammar_rows, metadata.grammar_bitmask = grammar
        sampled = self.sampler(logits, metadata).sampled_token_ids.tolist()
        probs = reported = None
        start = 0
        for state, count in zip(inputs.sampling_states, counts.tolist(), strict=True):
            end = start + count
            drafts = so.scheduled_spec_decode_tokens.get(state.req_id, [])
            if count == 1:
                tokens = [sampled[start]]
            elif (
                self.input_batch.temperature[self.input_batch.req_id_to_index[state.req_id]] == 0.0
            ):
                tokens = verify_greedy(sampled[start:end], drafts)
            else:
                if probs is None:
                    probs = self.sampler.target_probs(logits, metadata)
                draft_probs = None
                if isinstance(self.proposer, DraftModelProposer):
                    draft_probs = self.proposer.pop_draft_probs(state.req_id)
                tokens = verify_random(probs[start:end], drafts, state.generator, draft_probs)
            output.sampled_token_ids[state.req_id] = tokens
            k = self._num_logprobs(state)
            if k is not None:
                if reported is None:  # the logprobs_mode values of every row, once
                    reported = self.sampler.reported_logprobs(logits, metadata)
                chosen = state.sampling_params.logprob_token_ids  # type: ignore[union-attr]
                by_row = {r: chosen for r in range(len(tokens))} if chosen else None
                output.logprobs[state.req_id] = gather_logprobs(
                    reported[start : start + len(tokens)], k, torch.tensor(tokens), by_row
                )
            start = end

    def _propose(self, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        """Drafts for the next step, from each request's tokens including this step's."""
        if self.model_config.return_sampling_mask:  # masks are per sampled position
            return
        batch = self.input_batch
        if isinstance(self.proposer, DraftModelProposer):
            states = inputs.sampling_states
            output.spec_token_ids.update(
                self.proposer.propose(
                    batch,
                    inputs.sampling_rows.tolist(),
                    states,
                    [output.sampled_token_ids.get(s.req_id, []) for s in states],
                    self.attn_backend,
                    self.model_config.logprobs_mode,
                )
            )
            return
        for row, state in zip(inputs.sampling_rows.tolist(), inputs.sampling_states, strict=True):
            new = output.sampled_token_ids.get(state.req_id)
            if not new or not can_speculate(state):
                continue
            context = np.concatenate([batch.token_ids[row, : batch.num_tokens[row]], new])
            drafts = self.proposer.propose(context)
            if drafts:
                output.spec_token_ids[state.req_id] = drafts

    def _pool(self, inputs: StepInputs, hidden_states: torch.Tensor, output: ModelRunnerOutput):
        """Pool each prompt in the step that ends it: every row (its prompt is computed whole
        in one step), or for a LAST pooler the last row alone (its prompt may come in chunks)."""
        for state in inputs.states:
            if state.pooling_params is None:
                continue
            start, num_rows, position = inputs.output_spans[state.req_id]
            if position + num_rows < state.num_tokens:
                continue  # a chunk that does not end the prompt
            assert position == 0 or self._pool_last_row, "the pooler reads every row"
            rows = hidden_states[start : start + num_rows]
            with blame_request(state.req_id):
                pooled = self.model.pooler(rows, state.pooling_params)
            output.pooler_output[state.req_id] = pooled.float().cpu()

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden_states: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """Logprobs of prompt tokens 1..P-1 computed in this step's chunk of each request."""
        for state in inputs.states:
            params = state.sampling_params
            if params is None or params.prompt_logprobs is None:
                continue
            with blame_request(state.req_id):
                self._prompt_logprobs_of(state, inputs, hidden_states, output)

    def _prompt_logprobs_of(
        self,
        state: CachedRequestState,
        inputs: StepInputs,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """One request's prompt logprobs of this step (`_prompt_logprobs`)."""
        params = state.sampling_params
        assert params is not None
        row_start, num_rows, position = inputs.output_spans[state.req_id]
        # a row at position p predicts prompt token p + 1; rows already sent are skipped
        num_rows = min(num_rows, state.num_prompt_tokens - 1 - position)
        skip = min(max(state.num_prompt_logprobs_sent - position, 0), max(num_rows, 0))
        row_start, num_rows, position = row_start + skip, num_rows - skip, position + skip
        if num_rows <= 0:
            return
        state.num_prompt_logprobs_sent = position + num_rows
        k = params.prompt_logprobs
        targets = torch.tensor(
            state.prompt_token_ids[position + 1 : position + 1 + num_rows],
            device=hidden_states.device,
        )
        merged = LogprobsLists([], [], [])
        for s in range(0, num_rows, _PROMPT_LOGPROBS_CHUNK):
            e = min(num_rows, s + _PROMPT_LOGPROBS_CHUNK)
            logits = self.model.compute_logits(hidden_states[row_start + s : row_start + e])
            if logits is None:  # not the first tensor-parallel rank
                continue
            logprobs = logits.float().log_softmax(-1)
            part = gather_logprobs(logprobs, k, targets[s:e])
            merged.logprob_token_ids += part.logprob_token_ids
            merged.logprobs += part.logprobs
            merged.sampled_token_ranks += part.sampled_token_ranks
        if self.is_driver:
            output.prompt_logprobs[state.req_id] = merged
