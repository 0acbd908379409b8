"""Where a decode step's wall time goes on the host, and how long the GPU is busy in it.

``breakdown(core, bs)`` runs ``bs`` requests into steady decode, then times 48 steps phase by phase (schedule,
build_inputs, graph input copies + replay enqueue, logits + sampling enqueue, the wait for the sampled ids,
scheduler update) with host clocks, and the GPU span of each step with CUDA events recorded at the start of
the forward and after sampling. ``idle = wall - GPU span`` is the time per step the GPU waits for the host.
Called from bench/full_size.py (``onecard``) after the throughput figures, on the same engine.
"""
from __future__ import annotations

import statistics
import time

import torch


def breakdown(core, bs: int, vocab: int, steps: int = 48) -> dict:
    from onecard.protocol import EngineRequest
    from onecard.runner import model_runner as mr
    from onecard.sampling_params import SamplingParams

    runner, sched = core.runner, core.scheduler
    g = torch.Generator().manual_seed(3)
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(bs):
        core.add_request(EngineRequest(f"bd{time.time_ns()}-{i}", torch.randint(0, vocab, (512,), generator=g).tolist(),
                                       sp, time.monotonic(), []))
    for _ in range(3):                                                   # prefill, then into decode
        core.step()
    acc: dict[str, list[float]] = {k: [] for k in ("schedule", "build_inputs", "forward_enqueue",
                                                   "sample_enqueue", "wait_ids", "update", "wall", "gpu")}
    cur: dict[str, float] = {}
    ev: dict[str, torch.cuda.Event] = {}
    orig_build, orig_fwd, orig_sample = mr.build_inputs, runner._forward, runner.sampler.sample

    def build(*a, **k):
        t = time.perf_counter()
        r = orig_build(*a, **k)
        cur["build_inputs"] = time.perf_counter() - t
        return r

    def fwd(inputs):
        ev["a"] = torch.cuda.Event(enable_timing=True)
        ev["a"].record()
        t = time.perf_counter()
        r = orig_fwd(inputs)
        cur["forward_enqueue"] = time.perf_counter() - t
        cur["t_fwd_end"] = time.perf_counter()
        return r

    def sample(*a, **k):
        r = orig_sample(*a, **k)
        ev["b"] = torch.cuda.Event(enable_timing=True)
        ev["b"].record()
        cur["t_sample_end"] = time.perf_counter()
        return r

    mr.build_inputs, runner._forward, runner.sampler.sample = build, fwd, sample
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            so = sched.schedule()
            t1 = time.perf_counter()
            out = runner.execute(so)
            t2 = time.perf_counter()
            sched.update(so, out)
            t3 = time.perf_counter()
            acc["schedule"].append(t1 - t0)
            acc["build_inputs"].append(cur["build_inputs"])
            acc["forward_enqueue"].append(cur["forward_enqueue"])
            acc["sample_enqueue"].append(cur["t_sample_end"] - cur["t_fwd_end"])
            acc["wait_ids"].append(t2 - cur["t_sample_end"])
            acc["update"].append(t3 - t2)
            acc["wall"].append(t3 - t0)
            acc["gpu"].append(ev["a"].elapsed_time(ev["b"]) / 1e3)        # complete: the ids were read
    finally:
        mr.build_inputs, runner._forward, runner.sampler.sample = orig_build, orig_fwd, orig_sample
    while core.has_unfinished():
        core.step()
    res = {f"bs{bs}_{k}_us": statistics.median(v) * 1e6 for k, v in acc.items()}
    res[f"bs{bs}_gpu_idle_us"] = res[f"bs{bs}_wall_us"] - res[f"bs{bs}_gpu_us"]
    print(f"step breakdown bs={bs} (median us): " + ", ".join(
        f"{k.split('_', 1)[1][:-3]} {v:.0f}" for k, v in res.items()), flush=True)
    return res
