"""The pool of KV cache blocks: free queue (LRU eviction order) and the prefix-cache hash map.

Invariants (checked by `check_invariants` in tests):
- every block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt > 0);
- a block is in the hash map only if it carries that hash; a hash maps to one block;
- allocation pops the queue's front; freed cached blocks go to the back (least recently used
  is evicted first), freed uncached blocks to the front (they hold nothing worth keeping).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the front of the free queue, evicting their stale hashes."""
        if num_blocks > len(self.free_block_queue):
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop one reference of each block, in the order given (callers pass tail first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_block_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full, written block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def invalidate_prefix_cache(self) -> None:
        """Forget every hash, blocks in use included (their KV stays with their requests but
        is no longer shared): used when the weights that computed the cached KV change."""
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    def check_invariants(self, tables: list[list[KVCacheBlock]]) -> None:
        refs: dict[int, int] = {}
        for table in tables:
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (block, refs.get(block.block_id))
            assert (block.ref_cnt == 0) == (block.block_id in self.free_block_queue), block
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, block
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + self.get_num_free_blocks() == self.num_blocks
