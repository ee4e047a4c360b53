"""KV cache manager: which blocks each request holds, prefix-cache lookups, allocation, freeing.

Invariants: a request's blocks cover at least its computed tokens; a prefix hit is a run of
consecutive full blocks starting at the first and never covers the last token (so there is
always a token to compute logits from); only full blocks whose KV is written by the end of
the current step get a hash (an admitted prefill's blocks are registered when scheduled, so
requests admitted after it in the same step share them; attention backends write every new
token's KV for a layer before any attention in that layer reads the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.core.block_pool import BlockPool, KVCacheBlock
from pagedlm.core.request import Request
from pagedlm.utils import cdiv

_NEVER_CACHE = 1 << 62  # num_cached_block of a request whose blocks must not be shared


@dataclass
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found

    def reset(self) -> PrefixCacheStats:
        out = PrefixCacheStats(self.requests, self.queries, self.hits)
        self.requests = self.queries = self.hits = 0
        return out


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in blocks and tokens (< num_tokens)."""
        params = request.sampling_params
        skip = params is not None and params.skip_reading_prefix_cache
        if not self.enable_caching or skip:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_tokens_must_fit: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool is short.

        `num_tokens_must_fit` (admission): refuse unless blocks for that many tokens would fit.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_held = len(blocks) + len(new_computed_blocks)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(total, self.block_size) - num_held)
        num_needed = max(num_new_blocks, cdiv(num_tokens_must_fit, self.block_size) - num_held)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + revived > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and written up to `num_computed_tokens`."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        start = self.num_cached_block.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_block[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its head)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def invalidate_prefix_cache(self) -> None:
        """After a weight change: no cached block is reused, and the running requests (whose
        KV mixes old and new weights) never register more blocks."""
        self.block_pool.invalidate_prefix_cache()
        for request_id in self.req_to_blocks:
            self.num_cached_block[request_id] = _NEVER_CACHE

    def check_invariants(self) -> None:
        self.block_pool.check_invariants(list(self.req_to_blocks.values()))
