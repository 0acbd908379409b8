"""KV-cache manager: allocation, ref counts, LRU eviction, prefix hits, sharing, no leaks."""
from __future__ import annotations

import random

from onecard.core.kv_cache_manager import KVCacheManager
from onecard.core.request import Request
from onecard.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), 0.0)


def _admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does at admission: look up, allocate the rest, set num_computed_tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    ids = kv.allocate_slots(req, n, hits)
    if ids is not None:
        req.num_computed_tokens = num_hit
    return ids


def _check_invariants(kv: KVCacheManager, live: list[Request]) -> None:
    """Ref counts equal the number of holders; the free queue holds exactly the unreferenced blocks."""
    holders = [0] * kv.num_blocks
    for r in live:
        for b in kv.get_block_ids(r.request_id):
            holders[b] += 1
    assert holders[0] == 0, "the null block was handed out"
    for block in kv.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id]
    free = {b.block_id for b in kv.blocks[1:] if b.ref_cnt == 0}
    assert set(kv._free) == free and kv.num_free_blocks == len(free)
    for h, block in kv._cached.items():
        assert block.block_hash == h


def test_allocate_free_round_trip_and_null_block() -> None:
    kv = KVCacheManager(9, BS, enable_prefix_caching=True)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    a = _req("a", list(range(10)))
    ids = _admit(kv, a)
    assert ids is not None and len(ids) == 3 and 0 not in ids
    assert kv.usage == 3 / 8
    _check_invariants(kv, [a])
    kv.free(a)
    assert kv.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.blocks)


def test_grows_one_block_at_a_time_during_decode() -> None:
    kv = KVCacheManager(9, BS, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3])
    assert len(_admit(kv, a)) == 1
    a.num_computed_tokens = 3
    for step in range(10):
        a.append_output_token(100 + step)
        ids = kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert len(ids) == -(-a.num_computed_tokens // BS)
    _check_invariants(kv, [a])


def test_not_enough_blocks_changes_nothing() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)           # 3 usable blocks
    a = _req("a", list(range(8)))
    assert _admit(kv, a) is not None
    b = _req("b", list(range(100, 109)))                             # needs 3 blocks, 1 free
    assert _admit(kv, b) is None
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []
    _check_invariants(kv, [a])


def test_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(17, BS, enable_prefix_caching=True)
    a = _req("a", list(range(8)))                                    # exactly two full blocks
    _admit(kv, a)
    kv.free(a)
    hits, n = kv.get_computed_blocks(_req("b", list(range(8))))
    assert n == 4 and len(hits) == 1                                 # the last token must be computed
    hits, n = kv.get_computed_blocks(_req("c", list(range(9))))
    assert n == 8 and len(hits) == 2
    hits, n = kv.get_computed_blocks(_req("d", [0, 1, 2, 3, 4, 5, 6, 99, 8]))
    assert n == 4                                                    # block 1 differs


def test_freed_block_is_revived_by_a_hit() -> None:
    kv = KVCacheManager(9, BS, enable_prefix_caching=True)
    a = _req("a", list(range(9)))
    ids_a = _admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = _req("b", list(range(9)) + [50])
    ids_b = _admit(kv, b)
    assert ids_b[:2] == ids_a[:2] and b.num_computed_tokens == 8
    assert kv.num_free_blocks == 8 - 3
    assert kv.prefix_cache_queries == 9 + 10 and kv.prefix_cache_hits == 8
    _check_invariants(kv, [b])


def test_lru_evicts_least_recently_freed_and_tail_first() -> None:
    kv = KVCacheManager(1 + 6, BS, enable_prefix_caching=True)
    a = _req("a", list(range(9)))                                 # 2 full blocks + 1 partial
    b = _req("b", list(range(100, 109)))
    _admit(kv, a)
    _admit(kv, b)
    kv.free(a)                                                       # a freed first: evicted first
    kv.free(b)

    def hits(tokens: list[int]) -> int:
        return kv.get_computed_blocks(_req("q", tokens))[1]

    x = _req("x", list(range(200, 209)))                             # takes 3 fresh blocks
    _admit(kv, x)
    # the 2 uncached partial blocks went first, then a's TAIL full block; a's head and all of b survive
    assert hits(list(range(9))) == 4
    assert hits(list(range(100, 109))) == 8
    y = _req("y", list(range(300, 305)))                             # 2 more blocks: a's head, b's tail
    _admit(kv, y)
    assert hits(list(range(9))) == 0
    assert hits(list(range(100, 109))) == 4
    _check_invariants(kv, [x, y])


def test_token_equality_guards_hash_collisions() -> None:
    # A hash that depends only on the position: every block at the same position collides.
    def colliding(parent, tokens, extra):
        return 1 if parent is None else parent + 1

    kv = KVCacheManager(17, BS, enable_prefix_caching=True, hash_fn=colliding)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(_req("b", list(range(50, 59))))[1] == 0
    assert kv.get_computed_blocks(_req("c", list(range(4)) + list(range(50, 55))))[1] == 4
    assert kv.get_computed_blocks(_req("d", list(range(9))))[1] == 8


def test_siblings_share_blocks_in_the_same_step() -> None:
    kv = KVCacheManager(17, BS, enable_prefix_caching=True)
    prompt = list(range(10))
    a, b = _req("a-0", prompt), _req("a-1", prompt)
    ids_a = _admit(kv, a)                                            # registers blocks 0,1 at allocation
    ids_b = _admit(kv, b)
    assert b.num_computed_tokens == 8 and ids_b[:2] == ids_a[:2] and ids_b[2] != ids_a[2]
    assert [kv.blocks[i].ref_cnt for i in ids_a] == [2, 2, 1]
    assert kv.num_free_blocks == 16 - 4
    kv.free(a)
    assert [kv.blocks[i].ref_cnt for i in ids_b] == [1, 1, 1]       # still held by b
    _check_invariants(kv, [b])
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(9, BS, enable_prefix_caching=False)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    assert kv.num_cached_blocks() == 0 and a.block_hashes == []


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(9, BS, enable_prefix_caching=True)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    assert not kv.reset_prefix_cache()                               # refused while in use
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 0


def test_random_workload_keeps_invariants_and_kv_contents() -> None:
    """Random admissions / chunks / decodes / frees over shared prefixes. A shadow KV store records which
    token each slot holds; every hit must point at blocks whose stored tokens equal the request's tokens."""
    rng = random.Random(7)
    kv = KVCacheManager(1 + 24, BS, enable_prefix_caching=True)
    slots: dict[int, int] = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[Request] = []
    for step in range(600):
        if live and rng.random() < 0.25:
            r = live.pop(rng.randrange(len(live)))
            kv.free(r)
        elif rng.random() < 0.4 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            r = _req(f"r{step}", tokens)
            hits, num_hit = kv.get_computed_blocks(r)
            for pos in range(num_hit):                               # hit content is the request's own
                assert slots[hits[pos // BS].block_id * BS + pos % BS] == r.all_token_ids[pos]
            n = min(r.num_tokens - num_hit, rng.randrange(1, 9))
            ids = kv.allocate_slots(r, n, hits)
            if ids is None:
                continue
            r.num_computed_tokens = num_hit
            for pos in range(num_hit, num_hit + n):
                slots[ids[pos // BS] * BS + pos % BS] = r.all_token_ids[pos]
            r.num_computed_tokens += n
            live.append(r)
        else:
            r = rng.choice(live)
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(rng.randrange(50))
            n = min(r.num_tokens - r.num_computed_tokens, rng.randrange(1, 6))
            ids = kv.allocate_slots(r, n)
            if ids is None:
                continue
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                slots[ids[pos // BS] * BS + pos % BS] = r.all_token_ids[pos]
            r.num_computed_tokens += n
        _check_invariants(kv, live)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == 24 and all(b.ref_cnt == 0 for b in kv.blocks)
