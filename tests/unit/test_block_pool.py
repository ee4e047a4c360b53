"""BlockPool and KVCacheManager with tiny blocks: exact ids, ref counts, LRU order, hash chains."""

from __future__ import annotations

import pytest

from pagedlm.core.block_pool import BlockPool, KVCacheBlock
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request
from pagedlm.sampling_params import SamplingParams


def make_request(
    request_id: str,
    prompt: list[int],
    block_size: int,
    max_tokens: int = 8,
    cache_salt: str | None = None,
    **params: object,
) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        max_tokens=max_tokens,
        block_size=block_size,
        cache_salt=cache_salt,
    )


def ids(blocks: list[KVCacheBlock] | None) -> list[int]:
    assert blocks is not None
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_block_queue)


def admit(kv: KVCacheManager, request: Request) -> list[KVCacheBlock] | None:
    """What the scheduler does for a waiting request: look up hits, allocate the rest."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(
        request, request.num_tokens - num_hit, hits, num_hit, num_tokens_must_fit=request.num_tokens
    )
    if new is not None:
        request.num_computed_tokens = num_hit
    return new


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """Pretend the model wrote every scheduled token, then register the full blocks."""
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)


# ---------------------------------------------------------------------------- BlockPool


def test_pool_rejects_empty_and_overdraw() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)
    pool = BlockPool(3, enable_caching=True)
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3


def test_pool_new_blocks_come_from_the_front_with_ref_cnt_one() -> None:
    pool = BlockPool(5, enable_caching=True)
    got = pool.get_new_blocks(2)
    assert ids(got) == [0, 1]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert free_order(pool) == [2, 3, 4]
    assert pool.get_usage() == pytest.approx(0.4)
    assert ids(pool.get_new_blocks(1)) == [2]
    pool.check_invariants([got, [pool.blocks[2]]])


def test_pool_free_order_uncached_front_cached_back() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 0 1 2 3; free: 4 5
    pool.cache_block(blocks[0], b"h0")
    pool.cache_block(blocks[1], b"h1")
    pool.free_blocks(list(reversed(blocks)))  # tail first: 3 2 1 0
    # 3 then 2 go to the front (2 ends first), 1 then 0 go to the back (0 evicted last).
    assert free_order(pool) == [2, 3, 4, 5, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    # Cached blocks stay findable while free.
    assert pool.get_cached_block(b"h0") is blocks[0]
    pool.check_invariants([])


def test_pool_double_free_is_caught() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_pool_touch_revives_free_cached_block() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h")
    pool.free_blocks([block])
    assert free_order(pool) == [1, 2, 3, 0]
    pool.touch([block])
    assert block.ref_cnt == 1 and free_order(pool) == [1, 2, 3]
    pool.touch([block])  # a second request sharing it: no queue change
    assert block.ref_cnt == 2 and pool.get_num_free_blocks() == 3
    pool.check_invariants([[block], [block]])


def test_pool_reuse_evicts_stale_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free_blocks([b, a])  # queue: 1 0 (b evicted first)
    assert free_order(pool) == [1, 0]
    (reused,) = pool.get_new_blocks(1)
    assert reused is b and b.block_hash is None
    assert pool.get_cached_block(b"hb") is None
    assert pool.get_cached_block(b"ha") is a
    assert pool.cached_block_hash_to_block == {b"ha": a}


def test_pool_cache_block_first_writer_wins_and_disabled_caching() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    pool.cache_block(a, b"other")  # already hashed: ignored
    assert a.block_hash == b"same" and pool.get_cached_block(b"other") is None

    off = BlockPool(2, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    off.cache_block(c, b"h")
    assert c.block_hash is None and off.cached_block_hash_to_block == {}


def test_pool_check_invariants_detects_corruption() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.check_invariants([blocks])
    with pytest.raises(AssertionError):
        pool.check_invariants([blocks[:1]])  # ref count != table references
    blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError):
        pool.check_invariants([blocks])


# ------------------------------------------------------------------------ KVCacheManager


def test_allocate_exact_ids_and_refcounts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(10)), 4)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert ids(admit(kv, a)) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]
    assert free_order(kv.block_pool) == [3, 4, 5, 6, 7, 8, 9]
    kv.check_invariants()


def test_decode_growth_allocates_one_block_per_block_size_tokens() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    r = make_request("r", [1, 2, 3, 4], 4)
    assert ids(admit(kv, r)) == [0]
    r.num_computed_tokens = 4
    r.append_output_token_ids([5])
    assert ids(kv.allocate_slots(r, 1)) == [1]  # position 4 starts block 1
    r.num_computed_tokens = 5
    r.append_output_token_ids([6])
    assert kv.allocate_slots(r, 1) == []  # position 5 fits in block 1: nothing new, not None
    assert kv.get_block_ids("r") == [0, 1]
    kv.check_invariants()


def test_free_tail_first_and_shared_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(10)), 4)
    admit(kv, a)
    compute_all(kv, a)  # blocks 0, 1 full and cached; 2 partial
    b = make_request("b", list(range(8)) + [100, 101, 102], 4)
    hits, num_hit = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit == 8
    assert ids(kv.allocate_slots(b, 3, hits, num_hit, num_tokens_must_fit=11)) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.check_invariants()

    kv.free(a)  # 2 -> front; 1, 0 still held by b
    assert free_order(kv.block_pool) == [2, 4, 5, 6, 7, 8, 9]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    kv.free(b)  # tail first: 3 -> front, 1 -> back, 0 -> back
    assert free_order(kv.block_pool) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert kv.req_to_blocks == {} and kv.num_cached_block == {}
    kv.check_invariants()
    kv.free(b)  # freeing an unknown request is a no-op
    assert kv.block_pool.get_num_free_blocks() == 10


def test_hash_chain_different_first_block_means_no_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(12)), 4)
    admit(kv, a)
    compute_all(kv, a)
    c = make_request("c", [99, 1, 2, 3] + list(range(4, 12)), 4)  # only block 0 differs
    assert c.block_hashes[0] != a.block_hashes[0]
    assert c.block_hashes[1] != a.block_hashes[1]  # chained on the parent
    assert kv.get_computed_blocks(c) == ([], 0)
    d = make_request("d", list(range(4)) + [55, 5, 6, 7] + list(range(8, 13)), 4)
    hits, num_hit = kv.get_computed_blocks(d)  # block 0 equal, block 1 differs, block 2 equal
    assert ids(hits) == [0] and num_hit == 4


def test_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("a", list(range(8)), 4)  # exactly 2 full blocks
    admit(kv, a)
    compute_all(kv, a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    twin = make_request("twin", list(range(8)), 4)
    hits, num_hit = kv.get_computed_blocks(twin)
    assert ids(hits) == [0] and num_hit == 4  # the second block would leave nothing to compute
    longer = make_request("longer", list(range(9)), 4)
    hits, num_hit = kv.get_computed_blocks(longer)
    assert ids(hits) == [0, 1] and num_hit == 8
    short = make_request("short", list(range(4)), 4)
    assert kv.get_computed_blocks(short) == ([], 0)


def test_revived_free_cached_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5], 2)
    assert ids(admit(kv, a)) == [0, 1, 2]
    compute_all(kv, a)
    kv.free(a)
    assert free_order(kv.block_pool) == [2, 3, 1, 0]
    b = make_request("b", [1, 2, 3, 4, 9], 2)
    new = admit(kv, b)
    assert kv.get_block_ids("b") == [0, 1, 2] and ids(new) == [2]
    assert b.num_computed_tokens == 4
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [1, 1, 1, 0]
    assert free_order(kv.block_pool) == [3]
    assert kv.num_cached_block["b"] == 2
    kv.check_invariants()


def test_revived_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5], 2)
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)  # free: 2 3 | 1 0 (cached)
    hog = make_request("hog", [7, 7], 2)
    assert ids(admit(kv, hog)) == [2]
    # b hits 0 and 1 (both free) and needs 2 new blocks: 2 revived + 2 new > 3 free.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7], 2)
    hits, num_hit = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    before = (free_order(kv.block_pool), dict(kv.req_to_blocks))
    assert kv.allocate_slots(b, 3, hits, num_hit, num_tokens_must_fit=7) is None
    assert (free_order(kv.block_pool), dict(kv.req_to_blocks)) == before
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [0, 0, 1, 0]
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is kv.block_pool.blocks[0]
    kv.check_invariants()


def test_reused_cached_block_evicts_its_hash_lru_order() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5], 2)
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)  # free: 2 3 1 0
    x = make_request("x", [8, 8, 8, 8, 8], 2)
    assert ids(admit(kv, x)) == [2, 3, 1]  # uncached first, then a's tail block
    pool = kv.block_pool
    assert pool.blocks[1].block_hash is None
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
    again = make_request("again", [1, 2, 3, 4, 5], 2)
    hits, num_hit = kv.get_computed_blocks(again)
    assert ids(hits) == [0] and num_hit == 2  # chain stops at the evicted block
    kv.check_invariants()


def test_cache_salt_changes_the_first_hash() -> None:
    prompt = list(range(8))
    plain = make_request("p", prompt, 4)
    salted = make_request("s", prompt, 4, cache_salt="salt")
    other = make_request("o", prompt, 4, cache_salt="pepper")
    assert len(plain.block_hashes) == len(salted.block_hashes) == 2
    assert plain.block_hashes[0] != salted.block_hashes[0] != other.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]  # chained on the salted parent

    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    admit(kv, salted)
    compute_all(kv, salted)
    probe = make_request("probe", prompt + [9], 4)
    assert kv.get_computed_blocks(probe) == ([], 0)
    same_salt = make_request("ss", prompt + [9], 4, cache_salt="salt")
    hits, num_hit = kv.get_computed_blocks(same_salt)
    assert ids(hits) == [0, 1] and num_hit == 8


def test_block_hashes_grow_with_output_tokens() -> None:
    r = make_request("r", [1, 2, 3], 4)
    assert r.block_hashes == []
    r.append_output_token_ids([4])
    assert len(r.block_hashes) == 1
    assert r.block_hashes == make_request("q", [1, 2, 3, 4], 4).block_hashes
    r.append_output_token_ids([5, 6, 7])
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([8])
    assert r.block_hashes == make_request("q2", list(range(1, 9)), 4).block_hashes


def test_cache_blocks_only_full_written_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    r = make_request("r", [1, 2, 3, 4, 5, 6, 7], 2)
    kv.allocate_slots(r, 3)  # a chunk of 3 tokens: blocks 0, 1
    r.num_computed_tokens = 3
    kv.cache_blocks(r, 3)
    pool = kv.block_pool
    assert pool.blocks[0].block_hash == r.block_hashes[0]
    assert pool.blocks[1].block_hash is None  # half written
    assert kv.num_cached_block["r"] == 1
    kv.allocate_slots(r, 4)
    r.num_computed_tokens = 7
    kv.cache_blocks(r, 7)
    assert [pool.blocks[i].block_hash for i in range(4)] == [*r.block_hashes, None]
    assert kv.num_cached_block["r"] == 3
    kv.check_invariants()


def test_duplicate_prompts_computed_together_first_writer_wins() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3], 2)
    b = make_request("b", [1, 2, 3], 2)
    assert ids(admit(kv, a)) == [0, 1]
    assert ids(admit(kv, b)) == [2, 3]  # nothing cached yet: no hit
    compute_all(kv, a)
    compute_all(kv, b)
    pool = kv.block_pool
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
    assert pool.blocks[2].block_hash is None
    kv.free(b)  # its blocks are uncached: both to the front
    assert free_order(pool)[:2] == [2, 3]
    kv.check_invariants()


def test_caching_disabled_and_skip_reading() -> None:
    off = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5], 2)
    admit(off, a)
    compute_all(off, a)
    assert off.block_pool.cached_block_hash_to_block == {}
    assert off.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5], 2)) == ([], 0)

    on = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    admit(on, a)
    compute_all(on, a)
    skip = make_request("s", [1, 2, 3, 4, 5], 2, skip_reading_prefix_cache=True)
    assert on.get_computed_blocks(skip) == ([], 0)
    logprobs = make_request("lp", [1, 2, 3, 4, 5], 2, prompt_logprobs=1)
    assert on.get_computed_blocks(logprobs) == ([], 0)  # prompt logprobs imply skip


def test_prefix_cache_stats() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5], 2)
    admit(kv, a)
    compute_all(kv, a)
    kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5], 2))
    stats = kv.prefix_cache_stats.reset()
    assert (stats.requests, stats.queries, stats.hits) == (2, 10, 4)
    assert (kv.prefix_cache_stats.requests, kv.prefix_cache_stats.hits) == (0, 0)


def test_reset_prefix_cache_refused_while_in_use() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5], 2)
    admit(kv, a)
    compute_all(kv, a)
    cached = dict(kv.block_pool.cached_block_hash_to_block)
    assert len(cached) == 2
    assert kv.reset_prefix_cache() is False
    assert kv.block_pool.cached_block_hash_to_block == cached
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5], 2)) == ([], 0)
    kv.check_invariants()


def test_allocate_returns_none_when_short_and_leaves_state() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    big = make_request("big", list(range(9)), 2)  # 5 blocks > 4
    assert kv.allocate_slots(big, 9) is None
    assert "big" not in kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == 4

    r = make_request("r", [1, 2, 3], 2)
    assert ids(kv.allocate_slots(r, 3)) == [0, 1]
    r.num_computed_tokens = 3
    r.append_output_token_ids([4, 5, 6, 7, 8, 9])  # 9 tokens: would need 5 blocks
    order = free_order(kv.block_pool)
    assert kv.allocate_slots(r, 6) is None
    assert kv.get_block_ids("r") == [0, 1]
    assert free_order(kv.block_pool) == order
    assert ids(kv.allocate_slots(r, 5)) == [2, 3]  # 8 tokens: exactly the pool
    kv.check_invariants()


def test_num_tokens_must_fit_gate() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    r = make_request("r", list(range(10)), 2)  # 5 blocks for the whole prompt
    assert kv.allocate_slots(r, 2, num_tokens_must_fit=10) is None  # a 1-block chunk, refused
    assert "r" not in kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == 4
    s = make_request("s", list(range(8)), 2)
    got = kv.allocate_slots(s, 2, num_tokens_must_fit=8)  # fits: but only the chunk is taken
    assert ids(got) == [0]
    assert kv.block_pool.get_num_free_blocks() == 3
    kv.check_invariants()
