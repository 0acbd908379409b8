"""Scheduler: budgets, chunking, preemption, stops, errors, aborts, no leaks.

``SimRunner`` is a model runner without a model: it writes each scheduled token's (token id, position) into a
simulated paged KV cache through the block ids it is given, reads the whole context back through them, and
samples a token that is a hash of what it read. A scheduling or caching bug (a wrong block, a shared block
overwritten, a hit on the wrong tokens) changes what is read, so the output differs from ``reference_tokens``,
which generates the same function with no scheduler at all.
"""
from __future__ import annotations

import random

import pytest

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.request import Request, RequestStatus
from onecard.core.scheduler import Scheduler
from onecard.protocol import FinishReason, TokenLogprobs
from onecard.runner.step_io import RunnerOutput, SchedulerOutput
from onecard.sampling_params import SamplingParams

VOCAB = 97


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def reference_tokens(prompt: list[int], max_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(ctx)
        ctx.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


class SimRunner:
    """Also runs one step ahead (async scheduling): a position past a request's known tokens is its
    placeholder, the token this runner sampled for it in the previous step (as the GPU runner reads it)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.steps = 0
        self.last_sampled: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        bs = self.bs
        for sr in so.scheduled:                       # every layer stores all new KV before attention reads
            toks = sr.request.all_token_ids
            assert len(sr.block_ids) * bs >= sr.num_computed_tokens + sr.num_new_tokens
            for pos in range(sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens):
                assert sr.block_ids[pos // bs] != 0, "wrote into the null block"
                if pos < len(toks):
                    tok = toks[pos]
                else:                                 # the placeholder: only ever the one next token
                    assert pos == len(toks) and sr.num_new_tokens == 1
                    tok = self.last_sampled[sr.request.request_id]
                self.kv[sr.block_ids[pos // bs] * bs + pos % bs] = (tok, pos)
        sampled: dict[str, int] = {}
        for sr in so.scheduled:
            end = sr.num_computed_tokens + sr.num_new_tokens
            read = [self.kv[sr.block_ids[p // bs] * bs + p % bs] for p in range(end)]
            assert all(r is not None and r[1] == p for p, r in enumerate(read)), "read stale KV"
            if sr.samples:
                sampled[sr.request.request_id] = next_token([r[0] for r in read])
        self.steps += 1
        self.last_sampled = sampled
        return RunnerOutput(sampled)


def make(num_blocks: int = 64, block_size: int = 4, **sched) -> tuple[Scheduler, SimRunner]:
    sched.setdefault("max_model_len", 256)
    prefix = sched.pop("enable_prefix_caching", True)
    s = Scheduler(SchedulerConfig(**sched), CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
                  num_blocks)
    return s, SimRunner(num_blocks, block_size)


_arrival = [0.0]


def req(rid: str, prompt: list[int], max_tokens: int | None = 8, **sp) -> Request:
    _arrival[0] += 1.0
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp), _arrival[0])


def run_to_end(s: Scheduler, runner: SimRunner, max_steps: int = 10_000, check=None) -> dict[str, list[int]]:
    """Step until nothing is left; return each request's streamed tokens; check budgets every step."""
    streamed: dict[str, list[int]] = {}
    cfg = s.config
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert so.total_num_scheduled_tokens == sum(x.num_new_tokens for x in so.scheduled)
        assert len(so.scheduled) <= cfg.max_num_seqs and s.num_running <= cfg.max_num_seqs
        ones = [x.num_new_tokens == 1 for x in so.scheduled]
        assert ones == sorted(ones, reverse=True), "decodes must come first"
        if check:
            check(s, so)
        for out in s.update(so, runner.execute(so)):
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
    else:
        raise AssertionError("did not finish")
    assert_pool_full(s)
    return streamed


def assert_pool_full(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.blocks)
    assert not kv._req_blocks and not s.requests and not s.running and not s.waiting


# ---------------------------------------------------------------- budgets and chunking
def test_token_budget_and_chunked_prefill() -> None:
    s, runner = make(max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(req(f"r{i}", [i] * 10))
    so = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in so.scheduled] == [
        ("r0", 10, True), ("r1", 6, False)]
    s.update(so, runner.execute(so))
    so = s.schedule()                                  # r0 decodes, r1 finishes its prefill, r2 starts
    assert [(x.request.request_id, x.num_computed_tokens, x.num_new_tokens) for x in so.scheduled] == [
        ("r0", 10, 1), ("r1", 6, 4), ("r2", 0, 10)]
    assert so.total_num_scheduled_tokens == 15


def test_max_num_seqs() -> None:
    s, runner = make(max_num_seqs=2)
    for i in range(5):
        s.add_request(req(f"r{i}", [i + 1] * 3, max_tokens=2))
    so = s.schedule()
    assert [x.request.request_id for x in so.scheduled] == ["r0", "r1"] and s.num_waiting == 3
    first = s.update(so, runner.execute(so))          # a scheduled step is in flight until its update
    out = run_to_end(s, runner)
    for o in first:
        out[o.request_id] = o.new_token_ids + out.get(o.request_id, [])
    assert out == {f"r{i}": reference_tokens([i + 1] * 3, 2) for i in range(5)}


def test_long_prefill_token_threshold_chunks() -> None:
    s, runner = make(long_prefill_token_threshold=16, max_num_batched_tokens=100)
    s.add_request(req("long", list(range(40))))
    s.add_request(req("short", list(range(50, 60))))   # 10 < 16: not chunked
    chunks = []
    for _ in range(3):
        so = s.schedule()
        chunks.append([(x.request.request_id, x.num_new_tokens) for x in so.scheduled])
        s.update(so, runner.execute(so))
    assert chunks == [[("long", 16), ("short", 10)], [("short", 1), ("long", 16)], [("short", 1), ("long", 8)]]


def test_chunked_prefill_off_waits_for_room() -> None:
    s, runner = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(req("a", list(range(20))))
    s.add_request(req("b", list(range(30, 50))))
    s.add_request(req("c", list(range(60, 65))))       # would fit, but FCFS keeps it behind b
    so = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in so.scheduled] == [("a", 20)]
    s.update(so, runner.execute(so))
    so = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in so.scheduled] == [("a", 1), ("b", 20), ("c", 5)]


# ---------------------------------------------------------------- outputs match a scheduler-free reference
@pytest.mark.parametrize("prefix", [True, False])
def test_outputs_match_reference(prefix: bool) -> None:
    rng = random.Random(3)
    s, runner = make(num_blocks=40, max_num_batched_tokens=24, long_prefill_token_threshold=7,
                     enable_prefix_caching=prefix)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    prompts = {f"r{i}": shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))] for i in range(8)}
    for rid, p in prompts.items():
        s.add_request(req(rid, p, max_tokens=9))
    out = run_to_end(s, runner)
    assert out == {rid: reference_tokens(p, 9) for rid, p in prompts.items()}


def test_n_siblings_share_prompt_blocks_in_one_step() -> None:
    s, runner = make(num_blocks=32)
    prompt = list(range(1, 11))                        # 2 full blocks + 2 tokens
    for i in range(3):
        s.add_request(req(f"x-{i}", prompt, max_tokens=6))
    so = s.schedule()
    # x-0 computes the whole prompt; x-1 and x-2 hit its two full blocks, registered at allocation
    assert [(x.num_computed_tokens, x.num_new_tokens) for x in so.scheduled] == [(0, 10), (8, 2), (8, 2)]
    first = so.scheduled[0].block_ids
    for x in so.scheduled[1:]:
        assert x.block_ids[:2] == first[:2] and x.block_ids[2] != first[2]
    kv = s.kv_cache_manager
    assert [kv.blocks[b].ref_cnt for b in first] == [3, 3, 1]
    outs = s.update(so, runner.execute(so))
    assert [o.num_cached_tokens for o in outs] == [0, 8, 8]
    out = run_to_end(s, runner)
    ref = reference_tokens(prompt, 6)
    assert all(outs[i].new_token_ids + out[f"x-{i}"] == ref for i in range(3))
    assert kv.prefix_cache_hits == 16 and kv.prefix_cache_queries == 30


# ---------------------------------------------------------------- preemption
def test_preempts_latest_arrival_and_readmits_it_first() -> None:
    s, runner = make(num_blocks=1 + 6)                 # 24 token slots
    s.add_request(req("old", list(range(8)), max_tokens=12))
    s.add_request(req("mid", list(range(10, 16)), max_tokens=12))
    s.add_request(req("new", list(range(20, 27)), max_tokens=12))
    s.add_request(req("later", list(range(30, 33)), max_tokens=12))
    preempted = []
    for _ in range(40):
        so = s.schedule()
        if so.preempted_request_ids:
            preempted.append(so.preempted_request_ids)
            assert all(s.kv_cache_manager.get_block_ids(r) == [] for r in so.preempted_request_ids)
            if len(preempted) == 1:
                assert so.preempted_request_ids == {"new"}
                assert [r.request_id for r in s.waiting] == ["new", "later"]
                assert s.waiting[0].status == RequestStatus.PREEMPTED
                assert s.waiting[0].num_computed_tokens == 0
        s.update(so, runner.execute(so))
        if not s.has_unfinished():
            break
    assert preempted and s.num_preemptions == sum(len(p) for p in preempted)
    assert s.stats().num_preemptions == s.num_preemptions


def test_tiny_pool_everyone_finishes_correctly() -> None:
    rng = random.Random(11)
    s, runner = make(num_blocks=1 + 10, max_num_batched_tokens=20, max_model_len=64)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))] for i in range(14)}
    max_toks = {rid: rng.randrange(1, 40 - len(p)) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        assert s.add_request(req(rid, p, max_tokens=max_toks[rid])) is None
    out = run_to_end(s, runner)
    assert s.num_preemptions > 0
    assert out == {rid: reference_tokens(p, max_toks[rid]) for rid, p in prompts.items()}


def random_traffic(s: Scheduler, rng: random.Random, step, stops: dict | None = None) -> tuple[dict, set]:
    """400 steps of random arrivals (40 requests, half sharing an 8-token prefix, max_tokens 20) and aborts;
    ``step()`` runs one engine step each time. With ``stops``, each request also gets 6 random stop ids (kept
    there). Returns (prompts, aborted ids)."""
    shared = [rng.randrange(VOCAB) for _ in range(8)]
    prompts, aborted, n = {}, set(), 0
    for _ in range(400):
        if n < 40 and rng.random() < 0.3:
            rid = f"r{n}"
            prompts[rid] = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(5)]
            extra = {}
            if stops is not None:
                stops[rid] = set(rng.sample(range(VOCAB), 6))
                extra["stop_token_ids"] = sorted(stops[rid])
            s.add_request(req(rid, prompts[rid], max_tokens=20, **extra))
            n += 1
        if s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            outs = s.abort([rid])
            assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, FinishReason.ABORT)]
            aborted.add(rid)
        step()
    assert n == 40 and aborted
    return prompts, aborted


def test_random_arrivals_and_aborts_no_leak() -> None:
    rng = random.Random(5)
    s, runner = make(num_blocks=1 + 14, max_num_batched_tokens=16, long_prefill_token_threshold=6,
                     max_num_seqs=5, max_model_len=48)
    streamed: dict[str, list[int]] = {}

    def step() -> None:
        so = s.schedule()
        for o in s.update(so, runner.execute(so)):
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)

    prompts, aborted = random_traffic(s, rng, step)
    for rid, out in run_to_end(s, runner).items():
        streamed.setdefault(rid, []).extend(out)
    for rid, p in prompts.items():
        ref = reference_tokens(p, 20)
        got = streamed.get(rid, [])
        assert got == (ref[:len(got)] if rid in aborted else ref)


# ---------------------------------------------------------------- stops
class ScriptedRunner:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out, lps = {}, {}
        for sr in so.scheduled:
            if sr.samples:
                t = self.tokens.pop(0)
                out[sr.request.request_id] = t
                lps[sr.request.request_id] = TokenLogprobs(t, -0.5, 1, {t: -0.5})
        return RunnerOutput(out, lps)


def _drive(r: Request, tokens: list[int], **sched):
    s, _ = make(**sched)
    assert s.add_request(r) is None
    runner, outs = ScriptedRunner(tokens), []
    while s.has_unfinished():
        so = s.schedule()
        outs += s.update(so, runner.execute(so))
    assert_pool_full(s)
    return outs


def test_eos_stop_token_min_tokens_ignore_eos_and_length() -> None:
    def ends(r, tokens):
        outs = _drive(r, tokens)
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason, outs[-1].stop_reason

    r = req("a", [5, 6], max_tokens=10); r.eos_token_ids = [2]
    assert ends(r, [7, 2, 8]) == ([7, 2], FinishReason.STOP, None)
    r = req("b", [5, 6], max_tokens=10, stop_token_ids=[9])
    assert ends(r, [7, 9, 8]) == ([7, 9], FinishReason.STOP, 9)
    r = req("c", [5, 6], max_tokens=10, min_tokens=3); r.eos_token_ids = [2]
    assert ends(r, [2, 2, 2, 8]) == ([2, 2, 2], FinishReason.STOP, None)
    r = req("d", [5, 6], max_tokens=3, ignore_eos=True); r.eos_token_ids = [2]
    assert ends(r, [2, 2, 2, 2]) == ([2, 2, 2], FinishReason.LENGTH, None)
    r = req("e", [5, 6], max_tokens=2); r.eos_token_ids = [2]
    assert ends(r, [7, 2]) == ([7, 2], FinishReason.STOP, None)   # a stop wins over length on the same token


def test_outputs_carry_logprobs_and_prompt_info() -> None:
    outs = _drive(req("a", [5, 6, 7], max_tokens=2), [1, 4])
    assert [o.new_logprobs[0].token_id for o in outs] == [1, 4]
    assert all(o.num_prompt_tokens == 3 and o.num_cached_tokens == 0 for o in outs)
    assert [o.finished for o in outs] == [False, True]


def test_max_model_len_ends_with_length() -> None:
    outs = _drive(req("a", [1] * 10, max_tokens=None), list(range(40)), max_model_len=16)
    assert sum(len(o.new_token_ids) for o in outs) == 6 and outs[-1].finish_reason == FinishReason.LENGTH


# ---------------------------------------------------------------- errors
def test_too_long_messages_exact() -> None:
    s, _ = make(max_model_len=100)
    out = s.add_request(req("a", [1] * 90, max_tokens=20))
    assert out.finish_reason == FinishReason.ERROR and out.error_status == 400
    assert out.error == (
        "You passed 90 input tokens and requested 20 output tokens. However, the model's context length is "
        "only 100 tokens, resulting in a maximum input length of 80 tokens. Please reduce the length of the "
        "input prompt.")
    out = s.add_request(req("b", [1] * 100, max_tokens=None))
    assert out.error == (
        "The decoder prompt (length 100) is longer than the maximum model length of 100. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens.")
    assert s.add_request(req("c", [], max_tokens=4)).error_status == 400
    assert not s.has_unfinished()


def test_max_tokens_none_becomes_remaining_context_on_a_copy() -> None:
    s, _ = make(max_model_len=100)
    shared = SamplingParams(max_tokens=None)
    a = Request("a", [1] * 30, shared, 0.0)
    b = Request("b", [1] * 60, shared, 0.0)
    assert s.add_request(a) is None and s.add_request(b) is None
    assert (a.sampling_params.max_tokens, b.sampling_params.max_tokens, shared.max_tokens) == (70, 40, None)
    out = s.add_request(Request("c", [1] * 95, SamplingParams(max_tokens=None, min_tokens=10), 0.0))
    assert out.error_status == 400 and "min_tokens" in out.error


def test_queue_full_503() -> None:
    # two running slots and a queue of two: the first two waiting requests take the free slots at the next
    # step, so four can wait before the fifth is refused; once two run, two may wait
    s, _ = make(max_num_queued_reqs=2, max_num_seqs=2)
    for rid in "abcd":
        assert s.add_request(req(rid, [1])) is None
    out = s.add_request(req("e", [1]))
    assert out.error_status == 503 and "max-num-queued-reqs=2" in out.error
    s.schedule()
    assert s.num_running == 2 and s.num_waiting == 2
    assert s.add_request(req("f", [1])).error_status == 503


def test_request_larger_than_the_pool_is_refused() -> None:
    s, _ = make(num_blocks=1 + 4, max_model_len=64)    # 16 token slots
    assert s.add_request(req("a", [1] * 10, max_tokens=7)).error_status == 400
    assert s.add_request(req("b", [1] * 10, max_tokens=6)) is None


# ---------------------------------------------------------------- abort
def test_abort_running_and_waiting_frees_everything() -> None:
    s, runner = make(num_blocks=1 + 8, max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", [i + 1] * 6, max_tokens=20))
    so = s.schedule()
    s.update(so, runner.execute(so))
    assert s.num_running == 2 and s.num_waiting == 2
    outs = s.abort(["r0", "r3", "nope"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r0", FinishReason.ABORT),
                                                              ("r3", FinishReason.ABORT)]
    so = s.schedule()
    assert {"r0", "r3"} <= so.finished_request_ids
    s.abort(list(s.requests))
    assert_pool_full(s)
    assert s.stats().kv_cache_usage == 0.0 and s.stats().num_running == 0
