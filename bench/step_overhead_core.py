"""Scheduler overhead per engine step: schedule() + update() at steady decode, no model.

Usage: python bench/step_overhead_core.py [--requests 16] [--context 2000] [--steps 2000] [--no-prefix-caching]
Prints microseconds per step (mean, median, p99). Goal: well under 100 µs at 16 requests x 2,000 tokens
(the whole engine step overhead budget is 200 µs).
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.request import Request
from onecard.core.scheduler import Scheduler
from onecard.runner.step_io import RunnerOutput
from onecard.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()

    max_len = args.context + args.steps + 16
    bs = args.block_size
    num_blocks = args.requests * (max_len // bs + 2) + 1
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_len),
                      CacheConfig(block_size=bs, enable_prefix_caching=not args.no_prefix_caching), num_blocks)
    rng = random.Random(0)
    ids = [f"req-{i}" for i in range(args.requests)]
    for i, rid in enumerate(ids):
        prompt = [rng.randrange(150_000) for _ in range(args.context)]
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=args.steps + 8, ignore_eos=True),
                                  float(i), eos_token_ids=[151645]))
    # Prefill everything (not timed).
    while True:
        so = sched.schedule()
        sampled = {sr.request.request_id: 7 for sr in so.scheduled if sr.samples}
        sched.update(so, RunnerOutput(sampled))
        if all(sched.requests[r].num_output_tokens > 0 for r in ids):
            break

    # Long-lived objects (prompts, blocks) out of the cyclic GC's way, as an engine core does after start-up.
    gc.collect()
    gc.freeze()
    times = []
    tok = 0
    for _ in range(args.steps):
        tok = (tok + 1) % 150_000
        out = RunnerOutput({rid: tok for rid in ids})      # built outside the timed region: the runner's job
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        sched.update(so, out)
        times.append(time.perf_counter_ns() - t0)
        assert len(so.scheduled) == args.requests and so.total_num_scheduled_tokens == args.requests
    us = [t / 1000 for t in times]
    us.sort()
    print(f"schedule()+update(): {args.requests} requests, ~{args.context} tokens of context, block {bs}, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'}")
    print(f"  mean {statistics.fmean(us):.1f} us/step, median {us[len(us) // 2]:.1f}, "
          f"p99 {us[int(len(us) * 0.99)]:.1f}  ({statistics.fmean(us) / args.requests:.2f} us per request)")


if __name__ == "__main__":
    main()
