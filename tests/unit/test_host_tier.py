"""The host KV tier in the core (no model): evicted prefixes come back from host memory, not recomputed.

``HostSimRunner`` is test_scheduler's ``SimRunner`` (it writes each token's (id, position) into a simulated paged
pool and samples a hash of everything it reads back through the block ids) plus a simulated host memory: before a
step it makes the step's copies, saves then loads, bit for bit. A block saved before it was complete, a slot
reused while still needed, a load into the wrong block or a hit on the wrong tokens changes what is read, so the
tokens differ from ``reference_tokens`` (no scheduler, no cache) or the position check fails.
``LaggingHostRunner`` models async scheduling's worst case on a GPU: step n's reads and writes happen only when
step n+1 arrives, AFTER step n+1's copies unless the step says ``kv_transfer_wait`` (a side stream that overlaps
the step in flight); a missing wait shows up as wrong tokens.
"""
from __future__ import annotations

import random

import pytest

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.host_tier import HostKVTier
from onecard.core.kv_cache_manager import HostHit, KVBlock, KVCacheManager
from onecard.core.scheduler import Scheduler
from onecard.runner.step_io import RunnerOutput, SchedulerOutput
from tests.unit.test_scheduler import VOCAB, SimRunner, assert_pool_full, reference_tokens, req

BS = 4


class HostSimRunner(SimRunner):
    def __init__(self, num_blocks: int, block_size: int, num_host: int) -> None:
        super().__init__(num_blocks, block_size)
        self.host: list[list | None] = [None] * num_host
        self.saved = self.loaded = 0

    def transfer(self, so: SchedulerOutput) -> None:
        bs = self.bs
        for pairs in (so.kv_to_host, so.kv_from_host):
            slots = [s for _, s in pairs]
            assert len(set(slots)) == len(slots), "a host slot twice in one direction of one step"
            assert all(g != 0 for g, _ in pairs), "the null block moved"
        for g, slot in so.kv_to_host:                 # saves first: a block evicted and refilled in one step
            block = self.kv[g * bs:(g + 1) * bs]
            assert all(e is not None for e in block), "saved a block that is not full"
            self.host[slot] = block
        for g, slot in so.kv_from_host:
            assert self.host[slot] is not None, "loaded a host slot that was never written"
            self.kv[g * bs:(g + 1) * bs] = self.host[slot]
        self.saved += len(so.kv_to_host)
        self.loaded += len(so.kv_from_host)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.transfer(so)
        return super().execute(so)


class LaggingHostRunner(HostSimRunner):
    def __init__(self, num_blocks: int, block_size: int, num_host: int) -> None:
        super().__init__(num_blocks, block_size, num_host)
        self.pending: SchedulerOutput | None = None
        self.waits = 0

    def submit(self, so: SchedulerOutput) -> RunnerOutput | None:
        """Queue ``so``; return the output of the step that was in flight (computed now)."""
        prev, out = self.pending, None
        if so.kv_transfer_wait:
            self.waits += 1
            if prev is not None:
                out = SimRunner.execute(self, prev)
        self.transfer(so)
        if prev is not None and out is None:
            out = SimRunner.execute(self, prev)   # the step in flight reads/writes after these copies
        self.pending = so
        return out

    def flush(self) -> RunnerOutput | None:
        prev, self.pending = self.pending, None
        return None if prev is None else SimRunner.execute(self, prev)


def make_host(num_blocks: int, num_host: int, **sched) -> tuple[Scheduler, HostSimRunner]:
    sched.setdefault("max_model_len", 256)
    s = Scheduler(SchedulerConfig(**sched), CacheConfig(block_size=BS), num_blocks, num_host_blocks=num_host,
                  kv_block_bytes=100)
    return s, HostSimRunner(num_blocks, BS, num_host)


def check_host(s: Scheduler) -> None:
    """Budget and bookkeeping of the host tier: every slot is either free or holds exactly one entry."""
    host = s.kv_cache_manager.host
    assert host.num_used + host.num_free == host.num_slots
    slots = [host.slot_of(h) for h in host.lru_hashes()]
    assert len(set(slots)) == len(slots) and set(slots).isdisjoint(host._free)
    assert all(0 <= x < host.num_slots for x in slots)
    assert not host._pinned, "a slot stayed pinned after scheduling"


def run_one(s: Scheduler, runner, rid: str, prompt: list[int], max_tokens: int = 3) -> tuple[list[int], list]:
    """Run one request alone; return its tokens and its schedule outputs."""
    assert s.add_request(req(rid, prompt, max_tokens=max_tokens)) is None
    outs: list[int] = []
    sched: list[SchedulerOutput] = []
    while s.has_unfinished():
        so = s.schedule()
        sched.append(so)
        for o in s.update(so, runner.execute(so)):
            outs.extend(o.new_token_ids)
        check_host(s)
    assert_pool_full(s)
    return outs, sched


# ---------------------------------------------------------------- the tier itself
def test_host_tier_lru_budget_and_pins() -> None:
    t = HostKVTier(3)
    slots = [t.store(h, (h,)) for h in (10, 11, 12)]
    assert slots == [0, 1, 2] and t.usage == 1.0
    t.unpin_all()
    assert t.store(11, (11,)) is None                  # already held: refreshed, nothing to copy
    assert t.lookup(10, (10,)) == 0 and t.lookup(10, (99,)) is None   # tokens must match too
    t.touch(10)                                        # LRU order now 12, 11, 10
    assert t.store(13, (13,)) == 2 and t.lookup(12, (12,)) is None   # the least recent (12) went
    t.pin(t.slot_of(11))                               # 11 is read by a copy this step: 10 goes instead
    assert t.store(14, (14,)) == 0 and t.lru_hashes() == [11, 13, 14]
    assert t.store(15, (15,)) is None and t.num_dropped == 1   # 11 pinned, 13 and 14 stored (pinned) this step
    t.unpin_all()
    assert t.store(15, (15,)) == 1 and t.lru_hashes() == [13, 14, 15] and t.num_evicted == 3


def test_lookup_mixes_gpu_and_host_hits_and_allocation_is_atomic() -> None:
    kv = KVCacheManager(1 + 4, BS, True, num_host_blocks=8)
    a = req("a", list(range(13)))                    # 3 full blocks + 1 token
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 13, hits) is not None
    a.num_computed_tokens = 13
    kv.free(a)                                         # 3 cached blocks, free
    assert kv.take_transfers().to_host == []
    b = req("b", list(range(100, 113)))
    assert kv.allocate_slots(b, 13, []) is not None    # takes all 4 blocks: evicts a's 3 cached blocks
    t = kv.take_transfers()
    assert len(t.to_host) == 3 and kv.host.num_used == 3
    b.num_computed_tokens = 13
    kv.free(b)
    # a again: its blocks are all on the host now; b's are cached on the GPU
    a2 = req("a2", list(range(13)))
    hits, n = kv.get_computed_blocks(a2)
    assert n == 12 and all(type(h) is HostHit for h in hits)
    # not enough free blocks for 3 loads + 1 fresh if three are held elsewhere: refused, nothing changes
    c = req("c", list(range(200, 212)))
    assert kv.allocate_slots(c, 12, []) is not None
    before = (kv.num_free_blocks, kv.host.lru_hashes(), dict(kv._cached))
    assert kv.allocate_slots(a2, 1, hits) is None
    assert (kv.num_free_blocks, kv.host.lru_hashes(), dict(kv._cached)) == before
    assert kv.take_transfers().from_host == []


# ---------------------------------------------------------------- served from the host tier
def test_evicted_prefix_is_served_from_host_not_recomputed() -> None:
    rng = random.Random(1)
    s, runner = make_host(num_blocks=1 + 8, num_host=16, max_num_batched_tokens=64)
    prompt = [rng.randrange(VOCAB) for _ in range(22)]           # 5 full blocks + 2 tokens
    cold, _ = run_one(s, runner, "a", prompt)
    assert cold == reference_tokens(prompt, 3)
    for i in range(2):                                           # other prompts evict a's blocks from the GPU
        run_one(s, runner, f"x{i}", [rng.randrange(VOCAB) for _ in range(26)])
    kv = s.kv_cache_manager
    assert kv.get_computed_blocks(req("probe", prompt))[1] == 20
    assert not any(type(h) is KVBlock for h in kv.get_computed_blocks(req("probe2", prompt))[0]), \
        "the test needs the prefix gone from the GPU"
    hits_before = kv.host_hits
    again, sched = run_one(s, runner, "a-again", prompt)
    first = sched[0].scheduled[0]
    assert (first.num_computed_tokens, first.num_new_tokens) == (20, 2)    # only the 2 last tokens computed
    assert len(sched[0].kv_from_host) == 5 and first.block_ids[:5] == [g for g, _ in sched[0].kv_from_host]
    assert again == cold
    assert kv.host_hits - hits_before == 20
    st = s.stats()
    assert st.external_prefix_cache_hits == kv.host_hits
    assert st.kv_bytes_from_host == 100 * runner.loaded and st.kv_bytes_to_host == 100 * runner.saved
    assert 0 < st.host_kv_cache_usage <= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_churn_keeps_budget_and_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    s, runner = make_host(num_blocks=1 + 12, num_host=10, max_num_batched_tokens=16,
                          long_prefill_token_threshold=6, max_num_seqs=4, max_model_len=64)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(8, 20))] for _ in range(5)]
    prompts = {}
    for i in range(40):
        base = rng.choice(bases)
        prompts[f"r{i}"] = base + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
    max_toks = {rid: rng.randrange(1, 10) for rid in prompts}
    pending = list(prompts)
    out: dict[str, list[int]] = {}
    while pending or s.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                rid = pending.pop(0)
                assert s.add_request(req(rid, prompts[rid], max_tokens=max_toks[rid])) is None
        so = s.schedule()
        for o in s.update(so, runner.execute(so)):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_host(s)
    assert_pool_full(s)
    assert out == {rid: reference_tokens(p, max_toks[rid]) for rid, p in prompts.items()}
    kv = s.kv_cache_manager
    assert kv.host_hits > 0 and runner.saved > 0 and kv.host.num_evicted > 0   # the tier ran full and served


def test_full_tier_drops_the_oldest_prefixes_first() -> None:
    rng = random.Random(4)
    s, runner = make_host(num_blocks=1 + 6, num_host=6, max_num_batched_tokens=64)
    host = s.kv_cache_manager.host
    stored: list[int] = []                             # hashes in the order they entered the tier
    store = host.store

    def logged_store(h, toks):
        slot = store(h, toks)
        if slot is not None:
            stored.append(h)
        return slot

    host.store = logged_store
    prompts = [[rng.randrange(VOCAB) for _ in range(9)] for _ in range(9)]     # 2 full blocks each
    for i, p in enumerate(prompts):
        run_one(s, runner, f"p{i}", p)
    held = set(host.lru_hashes())
    gone = [h for h in stored if h not in held]
    assert len(stored) > host.num_slots and len(gone) == host.num_evicted > 0
    assert gone == stored[:len(gone)], "the tier dropped something newer than what it kept"
    assert host.lru_hashes() == stored[len(gone):]
    # nothing is left of the oldest prompt; the oldest one still held comes back from the host
    kv = s.kv_cache_manager
    oldest_held = next(i for i, p in enumerate(prompts)
                       if all(type(h) is HostHit for h in kv.get_computed_blocks(req("q", p))[0][:1])
                       and kv.get_computed_blocks(req("q", p))[1] == 8)
    assert oldest_held > 0 and kv.get_computed_blocks(req("q", prompts[0])) == ([], 0)
    out, sched = run_one(s, runner, "again", prompts[oldest_held])
    assert sched[0].scheduled[0].num_computed_tokens == 8 and len(sched[0].kv_from_host) == 2
    assert out == reference_tokens(prompts[oldest_held], 3)


def test_no_tier_without_prefix_caching_and_reset_clears_it() -> None:
    kv = KVCacheManager(1 + 4, BS, False, num_host_blocks=8)
    assert kv.host is None
    s, runner = make_host(num_blocks=1 + 4, num_host=8)
    run_one(s, runner, "a", list(range(13)))
    run_one(s, runner, "b", list(range(50, 63)))
    assert s.kv_cache_manager.host.num_used > 0
    assert s.reset_prefix_cache() and s.kv_cache_manager.host.num_used == 0


# ---------------------------------------------------------------- async scheduling and preemption
def _run_lagging(s: Scheduler, runner: LaggingHostRunner, add) -> dict[str, list[int]]:
    """EngineCore's async loop: schedule and submit step n+1, then update step n with its output."""
    streamed: dict[str, list[int]] = {}
    prev: SchedulerOutput | None = None
    for i in range(20_000):
        add(i)
        if not (s.has_unfinished() or prev is not None) and i > 400:
            break
        so = s.schedule()
        out = runner.flush() if so.is_empty else runner.submit(so)
        if prev is not None:
            for o in s.update(prev, out):
                streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
        prev = None if so.is_empty else so
        check_host(s)
    else:
        raise AssertionError("did not finish")
    assert_pool_full(s)
    return streamed


def _async_case(seed: int, drop_wait: bool = False) -> tuple[bool, Scheduler, LaggingHostRunner]:
    """Random arrivals over shared prefixes with stops, a pool small enough to preempt, async scheduling.
    Returns whether every request streamed its reference tokens and nothing leaked."""
    rng = random.Random(50 + seed)
    nb, nh = 1 + 10, 12
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_model_len=64, max_num_seqs=6,
                                  async_scheduling=True), CacheConfig(block_size=BS), nb, num_host_blocks=nh)
    runner = LaggingHostRunner(nb, BS, nh)
    if drop_wait:                                  # a broken core: its copies never queue behind the step in flight
        take = s.kv_cache_manager.take_transfers

        def no_wait():
            t = take()
            t.wait = False
            return t

        s.kv_cache_manager.take_transfers = no_wait
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(6, 18))] for _ in range(4)]
    prompts, max_toks, stops = {}, {}, {}
    arrivals = sorted(rng.sample(range(300), 30))

    def add(i: int) -> None:
        while arrivals and arrivals[0] == i:
            arrivals.pop(0)
            rid = f"r{len(prompts)}"
            prompts[rid] = p = rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))]
            max_toks[rid] = rng.randrange(1, 40 - len(p))
            stops[rid] = set(rng.sample(range(VOCAB), 2))
            assert s.add_request(req(rid, p, max_tokens=max_toks[rid], stop_token_ids=sorted(stops[rid]))) is None

    try:
        out = _run_lagging(s, runner, add)
    except AssertionError:
        if not drop_wait:
            raise
        return False, s, runner
    return out == {rid: reference_tokens(p, max_toks[rid], stops[rid]) for rid, p in prompts.items()}, s, runner


@pytest.mark.parametrize("seed", range(4))
def test_async_scheduling_with_preemption_and_host_tier(seed: int) -> None:
    ok, s, runner = _async_case(seed)
    assert ok
    kv = s.kv_cache_manager
    assert s.num_preemptions > 0 and kv.host_hits > 0 and runner.loaded > 0 and runner.saved > 0
    assert runner.waits > 0                        # copies that had to queue behind the step in flight


def test_async_wait_flag_is_needed() -> None:
    """Mutation check: the lagging runner catches copies that ignore the step in flight."""
    assert not all(_async_case(seed, drop_wait=True)[0] for seed in range(4))
