"""Scheduler with one step in flight (async scheduling): step n+1 is scheduled before step n's update.

The driver below is EngineCore's async loop without torch: schedule n+1, "launch" it (``SimRunner`` computes
it at once, taking each placeholder token from its previous step's samples, as the GPU runner does on the
device), then update with step n's output. ``SimRunner`` hashes everything it reads back through the block
ids, so a wrong block, a KV write lost or a placeholder mixed up changes the tokens; ``reference_tokens`` has
no scheduler at all. Every run must end with the pool full (no block leaks).
"""
from __future__ import annotations

import random

from onecard.core.request import RequestStatus
from onecard.core.scheduler import Scheduler
from onecard.protocol import FinishReason
from tests.unit.test_scheduler import (
    VOCAB,
    ScriptedRunner,
    assert_pool_full,
    make,
    random_traffic,
    reference_tokens,
    req,
)


class AsyncDriver:
    """Schedules one step ahead; records what the async path exercised, so the tests can check coverage."""

    def __init__(self, s: Scheduler, runner) -> None:
        self.s, self.runner = s, runner
        self.in_flight = None                        # (SchedulerOutput, RunnerOutput) not yet updated
        self.streamed: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.placeholder_steps = 0                   # steps that computed a token not yet known on the host
        self.finished_while_preempted = 0
        self.wasted = 0                              # tokens computed for requests that had already ended

    def step(self) -> None:
        s = self.s
        so = s.schedule()
        cfg = s.config
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.scheduled) <= cfg.max_num_seqs
        for sr in so.scheduled:
            r = sr.request
            assert r.num_output_placeholders <= 2         # one per step in flight: the last and this
            assert sr.num_computed_tokens + sr.num_new_tokens <= s.max_model_len
            if sr.num_computed_tokens + sr.num_new_tokens > r.num_tokens:
                self.placeholder_steps += 1
        result = self.runner.execute(so) if not so.is_empty else None
        if self.in_flight is not None:
            prev_so, prev_out = self.in_flight
            status = {sr.request.request_id: sr.request.status for sr in prev_so.scheduled}
            for o in s.update(prev_so, prev_out):
                self.streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
                    if status[o.request_id] == RequestStatus.PREEMPTED:
                        self.finished_while_preempted += 1
            self.wasted += sum(1 for sr in so.scheduled if sr.request.status == RequestStatus.FINISHED)
        self.in_flight = (so, result) if result is not None else None

    def busy(self) -> bool:
        return self.s.has_unfinished() or self.in_flight is not None

    def run_to_end(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.busy():
                break
            self.step()
        else:
            raise AssertionError("did not finish")
        assert_pool_full(self.s)
        return self.streamed


def test_async_matches_reference_with_chunking_and_prefix_hits() -> None:
    rng = random.Random(3)
    s, runner = make(max_num_batched_tokens=24, long_prefill_token_threshold=8, block_size=4)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    prompts = {f"r{i}": shared[:rng.randrange(5, 14)]
               + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
               for i in range(8)}
    for rid, p in prompts.items():
        assert s.add_request(req(rid, p, max_tokens=12)) is None
    d = AsyncDriver(s, runner)
    out = d.run_to_end()
    assert out == {rid: reference_tokens(p, 12) for rid, p in prompts.items()}
    assert d.placeholder_steps > 0 and s.kv_cache_manager.prefix_cache_hits > 0


def test_async_tiny_pool_preemption_everyone_finishes_correctly() -> None:
    preemptions = finished_preempted = 0
    for seed in range(12):
        rng = random.Random(100 + seed)
        s, runner = make(num_blocks=1 + 10, max_num_batched_tokens=20, max_model_len=64)
        prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))] for i in range(14)}
        max_toks = {rid: rng.randrange(1, 40 - len(p)) for rid, p in prompts.items()}
        stops = {rid: set(rng.sample(range(VOCAB), 3)) for rid in prompts}
        for rid, p in prompts.items():
            r = req(rid, p, max_tokens=max_toks[rid], stop_token_ids=sorted(stops[rid]))
            assert s.add_request(r) is None
        d = AsyncDriver(s, runner)
        out = d.run_to_end()
        assert out == {rid: reference_tokens(p, max_toks[rid], stops[rid]) for rid, p in prompts.items()}
        assert len(d.finished) == 14
        preemptions += s.num_preemptions
        finished_preempted += d.finished_while_preempted
    # the interesting paths ran: preemption with a token in flight, and a request whose in-flight token was
    # its last while it sat preempted in the waiting queue
    assert preemptions > 0 and finished_preempted > 0


def test_async_random_arrivals_aborts_and_stops_no_leak() -> None:
    rng = random.Random(7)
    s, runner = make(num_blocks=1 + 14, max_num_batched_tokens=16, long_prefill_token_threshold=6,
                     max_num_seqs=5, max_model_len=48)
    d = AsyncDriver(s, runner)
    stops: dict[str, set[int]] = {}
    prompts, aborted = random_traffic(s, rng, d.step, stops)
    d.run_to_end()
    stopped = 0
    for rid, p in prompts.items():
        ref = reference_tokens(p, 20, stops[rid])
        got = d.streamed.get(rid, [])
        assert got == (ref[:len(got)] if rid in aborted else ref)
        stopped += rid not in aborted and len(ref) < 20
    assert stopped > 0 and d.wasted > 0          # stop tokens ended requests that had a step in flight


def test_async_stop_token_emits_nothing_after_it() -> None:
    s, _ = make()
    r = req("a", [5, 6], max_tokens=10, stop_token_ids=[9])
    assert s.add_request(r) is None
    d = AsyncDriver(s, ScriptedRunner([7, 9, 8, 8]))
    d.run_to_end()
    assert d.streamed == {"a": [7, 9]} and d.finished == {"a": FinishReason.STOP}
    assert d.wasted == 1                          # the step after the stop token ran and was dropped


def test_async_max_tokens_and_max_model_len_schedule_nothing_past_the_end() -> None:
    s, _ = make(max_model_len=16)
    s.add_request(req("a", [1] * 10, max_tokens=None))    # 6 tokens of room
    s.add_request(req("b", [2] * 3, max_tokens=4))
    d = AsyncDriver(s, ScriptedRunner(list(range(30, 60))))
    d.run_to_end()
    assert len(d.streamed["a"]) == 6 and len(d.streamed["b"]) == 4
    assert d.finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert d.wasted == 0                          # a known last token is not followed by another step
