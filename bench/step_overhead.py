"""Python overhead of one engine step, everything but the forward: schedule() + input preparation
(build_inputs, the sampling batch, host->device copies) + update(), at steady decode.

Usage: python bench/step_overhead.py [--requests 16] [--context 2000] [--steps 500] [--device cpu|cuda]
Prints µs per step (median, mean, p99). Goal (issue 3): <= 200 µs at 16 requests x 2,000 tokens.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.request import Request
from onecard.core.scheduler import Scheduler
from onecard.runner.input_batch import build_inputs
from onecard.runner.sampler import Sampler
from onecard.runner.step_io import RunnerOutput
from onecard.sampling_params import SamplingParams


class _InputsOnlyRunner:
    """The runner's host work with the forward replaced by a [B, V] logits tensor."""

    def __init__(self, device: str, vocab: int):
        from onecard.runner.model_runner import ModelRunner

        self.device = torch.device(device)
        self.block_size = 16
        self.block_tables: dict = {}
        self.states: dict = {}
        self.sampler = Sampler(0, self.device)
        self.logits = torch.randn(256, vocab, device=self.device)
        self.sampling_batch = ModelRunner.sampling_batch.__get__(self)

    def execute(self, so) -> RunnerOutput:
        inputs = build_inputs(so, self.block_size, self.block_tables)
        dev = self.device
        for a in (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                  inputs.seq_lens, inputs.block_table):
            torch.from_numpy(a).to(dev, non_blocking=True)
        reqs = [so.scheduled[i].request for i in inputs.sample_rows]
        batch = self.sampling_batch(reqs, self.logits.shape[-1])
        tokens = self.sampler.sample(self.logits[:len(reqs)], batch).token_ids.tolist()
        return RunnerOutput({r.request_id: t for r, t in zip(reqs, tokens)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    max_len = args.context + args.steps + 32
    num_blocks = args.requests * (max_len // 16 + 2) + 1
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=65536, max_model_len=max_len),
                      CacheConfig(block_size=16), num_blocks)
    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(150_000) for _ in range(args.context)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=args.steps + 16,
                                                                  ignore_eos=True), float(i), [151645]))
    # On the CPU the sampler's arithmetic over a 152k vocabulary is itself "device" work (~10 ms), so there
    # a small vocabulary isolates the Python overhead; on a GPU the real vocabulary is used.
    runner = _InputsOnlyRunner(args.device, 151936 if args.device == "cuda" else 1024)
    so = sched.schedule()                                   # the prefill step (not timed, no forward)
    sched.update(so, RunnerOutput({s.request.request_id: 7 for s in so.scheduled if s.samples}))
    gc.collect()
    gc.freeze()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        out = runner.execute(so)
        sched.update(so, out)
        times.append((time.perf_counter() - t0) * 1e6)
    times = times[20:]
    times.sort()
    print(f"engine step overhead ({args.requests} requests x {args.context} tokens, {args.device}): "
          f"median {statistics.median(times):.0f} us, mean {statistics.mean(times):.0f} us, "
          f"p99 {times[int(len(times) * 0.99)]:.0f} us")


if __name__ == "__main__":
    main()
