"""The attention backend interface: build per-step metadata once, then attend per layer.

Batch layout contract (the model runner orders requests this way): decode requests
(exactly one new token) come first, then requests with several new tokens (prefill chunks).
KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_size], token-major.

Output rows: a step may use the outputs of only the last `output_query_lens[i]` query rows of
each request (its sampled rows). A model's last layer then passes the queries of those rows
only: `forward` still writes every token's key/value, and attends the given rows alone, from
the cache (a suffix of a request's rows sees the same causal context as it does in the whole).
The backend describes those rows as a batch of its own, every chunk read from the cache; its
one-row requests need not come first. A query with fewer rows than the step's tokens is the
output rows' (they are never padded); more rows than tokens is padding, ignored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one step, as numpy arrays (host side)."""

    query_start_loc: np.ndarray  # [num_reqs + 1] int64, cumulative query lengths
    seq_lens: np.ndarray  # [num_reqs] int64, tokens in the cache after this step
    block_table: np.ndarray  # [num_reqs, max_blocks] int64 (padded with 0)
    slot_mapping: np.ndarray  # [num_tokens] int64, cache slot of every new token
    num_decodes: int  # the first num_decodes requests have query length 1
    # [num_reqs] trailing query rows whose outputs the step uses; None: every row
    output_query_lens: np.ndarray | None = None
    # [k, 4] (request, first query row, rows, end position): those query rows attend every
    # key before `end` (an image's tokens attending each other both ways), not only earlier
    # ones; the keys up to `end` are in the cache once the step's keys are written
    bidirectional_spans: np.ndarray | None = None


def num_leading_decodes(query_lens: np.ndarray) -> int:
    """How many requests at the front of the batch have query length 1."""
    several = query_lens != 1
    return int(np.argmax(several)) if several.any() else len(query_lens)


class AttentionBackend(ABC):
    @abstractmethod
    def build(self, common: CommonAttentionMetadata, device: torch.device) -> object:
        """Turn the step description into whatever `forward` needs."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens or num output rows, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        metadata: object,
        scale: float,
        sliding_window: int | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [query rows, num_heads, head_size]
        """Write key/value into the cache at the slot mapping, then attend: every token's query,
        or the output rows' queries (fewer rows than tokens). An fp8 cache stores key / k_scale
        and value / v_scale (see kv_cache_dtype.py)."""

    def forward_encoder(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        """Bidirectional attention within each request (encoder-only models, no KV cache)."""
        raise NotImplementedError(f"{type(self).__name__} has no encoder attention")


def get_attn_backend(device: torch.device) -> AttentionBackend:
    from pagedlm.attention.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend()
