"""build_inputs: the decode-only fast path gives exactly the general path's arrays (steady decode with block
tables that grow, requests that finish, a sampling flag per row)."""
from __future__ import annotations

import random

import numpy as np

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.outputs import RunnerOutput
from onecard.core.request import Request
from onecard.core.scheduler import Scheduler
from onecard.runner import input_batch
from onecard.sampling_params import SamplingParams


def test_decode_fast_path_equals_general_path():
    rng = random.Random(0)
    bs = 16
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=400),
                      CacheConfig(block_size=bs), 400)
    for i in range(6):
        sched.add_request(Request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(5, 40))],
                                  SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 60), ignore_eos=True),
                                  float(i), [1]))
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
