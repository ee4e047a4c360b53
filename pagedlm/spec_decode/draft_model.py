"""Drafts from a smaller model that shares the target's tokenizer.

The draft model keeps its own KV cache in the same block ids as the target (the scheduler
reserves `num_speculative_tokens` lookahead slots past each step's tokens for it). Each step:
1. `prefill`: the draft runs over exactly the tokens the target ran over, so its cache holds
   every position the target's does (rejected drafts' positions are overwritten later, as the
   target's are);
2. `propose`: from each request's last sampled token, k decode steps of the draft write their
   KV in the lookahead slots and draw the drafts: argmax for greedy requests, else a draw from
   the draft's own filtered distribution q (kept, so rejection sampling can use min(1, p/q)).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedlm.attention.backend import CommonAttentionMetadata
from pagedlm.config import VllmConfig
from pagedlm.forward_context import set_forward_context
from pagedlm.layers.attention import paged_attention_layers
from pagedlm.layers.sampler import Sampler
from pagedlm.model_loader.loader import get_model
from pagedlm.spec_decode.ngram_proposer import can_speculate
from pagedlm.worker.input_batch import CachedRequestState, InputBatch
from pagedlm.worker.sampling_metadata import build_sampling_metadata


class DraftModelProposer:
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.device = device
        self.model = get_model(spec.draft_model_config, device)
        self.attn_layers = paged_attention_layers(self.model)  # KV in the target's block ids
        self.draft_probs: dict[str, torch.Tensor] = {}  # req_id -> q of its pending drafts

    # -------------------------------------------------------------------- step
    def prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata,
        output_rows: torch.Tensor | None = None,
    ) -> None:
        """Fill the draft's KV for this step's tokens (the target's metadata: same slots). Its
        outputs are not used: its last layer computes the target's output rows alone, if any."""
        kwargs = {}
        if output_rows is not None and self.model.supports_output_rows:
            kwargs["output_rows"] = output_rows
        with set_forward_context(attn_metadata):
            self.model(input_ids, positions, **kwargs)

    def propose(
        self,
        batch: InputBatch,
        rows: list[int],
        states: list[CachedRequestState],
        new_tokens: list[list[int]],
        attn_backend,
        logprobs_mode: str,
    ) -> dict[str, list[int]]:
        """k drafts for each request that can speculate, from its tokens of this step."""
        picked = [
            i for i, s in enumerate(states) if new_tokens[i] and can_speculate(s) and self.k > 0
        ]
        for state in states:
            self.draft_probs.pop(state.req_id, None)
        if not picked:
            return {}
        rows_np = np.array([rows[i] for i in picked], dtype=np.int64)
        states = [states[i] for i in picked]
        tokens = [new_tokens[i][-1] for i in picked]
        # position of each request's last sampled token (not yet in any cache)
        positions = batch.num_tokens[rows_np] + np.array([len(new_tokens[i]) for i in picked]) - 1
        md = build_sampling_metadata(batch, rows_np, states, self.device, logprobs_mode)
        greedy = batch.temperature[rows_np] == 0.0
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        for _ in range(self.k):
            live = positions < self.max_model_len
            if not live.any():
                break
            logits = self._decode(batch, rows_np, np.asarray(tokens), positions, attn_backend)
            q = None if greedy.all() else Sampler.filtered_probs(logits.float(), md)
            argmax = logits.argmax(-1).tolist()
            for i, state in enumerate(states):
                if not live[i]:
                    continue
                if greedy[i]:
                    token = argmax[i]
                else:
                    token = int(torch.multinomial(q[i], 1, generator=state.generator).item())
                    probs[i].append(q[i])
                drafts[i].append(token)
                tokens[i] = token
            positions = positions + 1
        out = {}
        for i, state in enumerate(states):
            if drafts[i]:
                out[state.req_id] = drafts[i]
                if probs[i]:
                    self.draft_probs[state.req_id] = torch.stack(probs[i])
        return out

    def _decode(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        attn_backend,
    ) -> torch.Tensor:
        """One draft decode step: token `tokens[i]` at `positions[i]` for row `rows[i]`."""
        n = len(rows)
        block_size = self.attn_layers[0].kv_cache.shape[2]
        positions = np.minimum(positions, self.max_model_len - 1)  # finished rows: harmless
        max_blocks = int(batch.num_blocks[rows].max())
        table = batch.block_table[rows, :max_blocks]
        slots = table[np.arange(n), positions // block_size] * block_size + positions % block_size
        common = CommonAttentionMetadata(
            query_start_loc=np.arange(n + 1, dtype=np.int64),
            seq_lens=positions + 1,
            block_table=table,
            slot_mapping=slots,
            num_decodes=n,
        )
        metadata = attn_backend.build(common, self.device)
        with set_forward_context(metadata):
            hidden = self.model(
                torch.from_numpy(tokens.astype(np.int64)).to(self.device),
                torch.from_numpy(positions.astype(np.int64)).to(self.device),
            )
        return self.model.compute_logits(hidden)

    def pop_draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.draft_probs.pop(req_id, None)
