"""build_inputs: the decode-only fast path gives exactly the general path's arrays (steady decode with block
tables that grow, requests that finish, a sampling flag per row)."""
from __future__ import annotations

import random

import numpy as np

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.request import Request
from onecard.core.scheduler import Scheduler
from onecard.runner import input_batch
from onecard.runner.step_io import RunnerOutput
from onecard.sampling_params import SamplingParams


def _scheduler(rng: random.Random, bs: int, budget: int, max_prompt: int, max_tokens: int) -> Scheduler:
    """Six greedy requests of random lengths in a scheduler with KV blocks of ``bs`` tokens."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=400),
                      CacheConfig(block_size=bs), 400)
    for i in range(6):
        sched.add_request(Request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(5, max_prompt))],
                                  SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, max_tokens),
                                                 ignore_eos=True), float(i), [1]))
    return sched


def test_decode_fast_path_equals_general_path():
    rng = random.Random(0)
    bs = 16
    sched = _scheduler(rng, bs, 4096, 40, 60)
    fast_cache: dict = {}
    slow_cache: dict = {}
    decode_steps = 0
    while sched.has_unfinished():
        so = sched.schedule()
        slow = input_batch._general_inputs(so, bs, slow_cache)
        fast = input_batch.build_inputs(so, bs, fast_cache)
        if all(s.num_new_tokens == 1 for s in so.scheduled):
            decode_steps += 1
        for f in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table",
                  "logits_indices"):
            a, b = getattr(fast, f), getattr(slow, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), f
        assert (fast.sample_rows, fast.max_query_len, fast.max_seq_len, fast.num_decode_tokens) == \
               (slow.sample_rows, slow.max_query_len, slow.max_seq_len, slow.num_decode_tokens)
        sched.update(so, RunnerOutput({s.request.request_id: rng.randrange(1000) for s in so.scheduled if s.samples}))
    assert decode_steps > 30


def test_placeholders_with_a_step_in_flight():
    """Async scheduling: step n+1 is built before step n's ids are known. Both paths list the same placeholder
    rows, each pointing at its request's row in step n's samples, and write every known id as it is."""
    rng = random.Random(1)
    bs = 16
    sched = _scheduler(rng, bs, 64, 90, 40)
    fast_cache: dict = {}
    slow_cache: dict = {}
    in_flight = None                                   # (SchedulerOutput, sampled ids, request id -> row)
    placeholders = mixed = 0
    while sched.has_unfinished() or in_flight:
        so = sched.schedule()
        last_rows = in_flight[2] if in_flight else None
        if so.scheduled:
            slow = input_batch._general_inputs(so, bs, slow_cache, last_rows)
            fast = input_batch.build_inputs(so, bs, fast_cache, last_rows)
            assert (fast.placeholder_rows, fast.placeholder_src) == (slow.placeholder_rows, slow.placeholder_src)
            assert np.array_equal(fast.input_ids, slow.input_ids)
            expect_rows, expect_src = [], []
            for row, s in zip(slow.query_start_loc[:-1], so.scheduled):
                toks = s.request.all_token_ids
                p = s.num_computed_tokens
                if p >= len(toks):                     # its id is step n's sample: placeholder
                    expect_rows.append(int(row))
                    expect_src.append(last_rows[s.request.request_id])
                else:
                    assert slow.input_ids[row:row + s.num_new_tokens].tolist() == toks[p:p + s.num_new_tokens]
            assert (slow.placeholder_rows or [], slow.placeholder_src or []) == (expect_rows, expect_src)
            assert all(slow.input_ids[r] == 0 for r in expect_rows)
            placeholders += len(expect_rows)
            mixed += bool(expect_rows) and slow.num_decode_tokens < len(so.scheduled)
        if in_flight is not None:
            sched.update(in_flight[0], RunnerOutput(dict(zip(in_flight[2], in_flight[1]))))
        ids = [s.request.request_id for s in so.scheduled if s.samples]
        in_flight = None
        if ids:
            in_flight = (so, [rng.randrange(1000) for _ in ids], {rid: i for i, rid in enumerate(ids)})
    assert placeholders > 50 and mixed > 0             # the general (mixed prefill + decode) path had some
