"""Where a decode step's time goes, on the GPU: per-kernel device time (torch.profiler / CUPTI) for one eager
decode forward of the full-shape model at batch 1 and 16 (context 512), next to the CUDA-graph step time,
and of one 4,096-token prefill forward.

Usage (on the H200, repo root): python bench/profile_decode.py MODEL_DIR OUT.json
MODEL_DIR: a checkpoint from ``bench/full_size.py build`` (``ONECARD_BENCH_LAYERS=8`` builds a shorter one
with the same per-layer shapes; per-layer figures do not depend on the layer count).
Prints, per batch size: graph-replay µs per step, eager µs per step, and the kernels sorted by device time
(calls per step, µs per call, µs per step). JSON has the same.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.full_size import _engine
from onecard.kernels.attention.metadata import AttentionMetadata


def decode_inputs(runner, bs: int, ctx: int):
    dev, block = runner.device, runner.block_size
    per = -(-(ctx + 1) // block)
    table = (1 + torch.arange(bs * per, device=dev, dtype=torch.int32)).view(bs, per)
    seq_lens = torch.full((bs,), ctx + 1, dtype=torch.int32, device=dev)
    slots = (table[:, ctx // block].long() * block + ctx % block)
    # max_seq_len = max_model_len, as the runner's CUDA graphs use it (so split-KV attention is on, as served)
    md = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=dev),
                           seq_lens=seq_lens, block_table=table, max_query_len=1,
                           max_seq_len=runner.config.scheduler.max_model_len, num_decode_tokens=bs)
    ids = torch.randint(0, 1000, (bs,), device=dev)
    pos = torch.full((bs,), ctx, dtype=torch.long, device=dev)
    return ids, pos, md


@torch.inference_mode()
def profile(runner, bs: int, ctx: int = 512, steps: int = 5) -> dict:
    model, kv = runner.model, runner.kv_caches
    ids, pos, md = decode_inputs(runner, bs, ctx)
    fwd = lambda: model.compute_logits(model(ids, pos, kv, md))
    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fwd()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / 20 * 1e6
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fwd()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - t0) / 50 * 1e6
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    graph_rows = kernel_rows(prof, steps)                   # CUPTI sees the kernels inside graph replays
    critical = critical_path(prof, steps)
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd()
        torch.cuda.synchronize()
    rows = kernel_rows(prof, steps)
    gtotal = sum(r["us_per_step"] for r in graph_rows)
    print(f"--- bs={bs} ctx={ctx}, inside the CUDA graph: kernel time {gtotal:.0f} us/step")
    for r in graph_rows[:25]:
        print(f"  {r['us_per_step']:8.1f} us/step {r['calls_per_step']:6.0f} x {r['us_per_call']:7.2f} us  {r['kernel']}")
    print(f"--- bs={bs}: critical path inside the graph (end of a kernel minus the latest end before it; with PDL "
          f"kernels overlap, so this, not the duration, is what each costs): {sum(critical.values()):.0f} us/step")
    for name, us in sorted(critical.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {us:8.1f} us/step  {name}")
    total = sum(r["us_per_step"] for r in rows)
    calls = sum(r["calls_per_step"] for r in rows)
    print(f"--- bs={bs}: graph replay {graph_us:.0f} us/step vs {gtotal:.0f} us of kernels inside it: "
          f"{(graph_us - gtotal) / max(1, sum(r['calls_per_step'] for r in graph_rows)):.2f} us between kernels")
    print(f"--- bs={bs} ctx={ctx}: graph {graph_us:.0f} us/step, eager {eager_us:.0f} us/step, kernel time "
          f"{total:.0f} us/step over {calls:.0f} kernels/step ({len(model.layers)} layers)")
    for r in rows[:12]:
        print(f"  {r['us_per_step']:8.1f} us/step {r['calls_per_step']:6.0f} x {r['us_per_call']:7.2f} us  {r['kernel']}")
    return {"bs": bs, "ctx": ctx, "graph_us": graph_us, "eager_us": eager_us, "kernel_us": total, "kernels": calls,
            "layers": len(model.layers), "rows": rows, "graph_kernel_us": gtotal, "graph_rows": graph_rows,
            "critical_us": critical}


def critical_path(prof, steps: int) -> dict[str, float]:
    """µs per step that each kernel name adds to the stream's timeline: kernels sorted by start, each charged
    max(0, its end - the latest end so far). Gaps between kernels are charged to the kernel after them."""
    evs = [e for e in prof.events() if getattr(e, "device_type", None) is not None
           and str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start]
    evs.sort(key=lambda e: e.time_range.start)
    out: dict[str, float] = {}
    last = None
    for e in evs:
        end = e.time_range.end
        if last is not None and e.time_range.start - last > 50:           # between replays: not a step's time
            last = e.time_range.start
        inc = end - last if last is not None else end - e.time_range.start
        if inc > 0:
            out[e.name[:90]] = out.get(e.name[:90], 0.0) + inc / steps
            last = end
    return out


def kernel_rows(prof, steps: int) -> list[dict]:
    rows = []
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None)
        if dt is None:
            dt = ev.cuda_time_total
        if dt <= 0 or ev.count == 0:
            continue
        rows.append({"kernel": ev.key[:90], "calls_per_step": ev.count / steps, "us_per_call": dt / ev.count,
                     "us_per_step": dt / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


@torch.inference_mode()
def profile_prefill(runner, t: int = 4096, steps: int = 2) -> dict:
    """One eager forward of a single t-token prompt (no cached prefix), per-kernel device time."""
    model, kv, dev, block = runner.model, runner.kv_caches, runner.device, runner.block_size
    per = -(-t // block)
    table = (1 + torch.arange(per, device=dev, dtype=torch.int32)).view(1, per)
    slots = table[0].long().repeat_interleave(block)[:t] * block + torch.arange(t, device=dev) % block
    md = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
                           seq_lens=torch.tensor([t], dtype=torch.int32, device=dev), block_table=table,
                           max_query_len=t, max_seq_len=t, num_decode_tokens=0)
    ids = torch.randint(0, 1000, (t,), device=dev)
    pos = torch.arange(t, dtype=torch.long, device=dev)
    fwd = lambda: model.compute_logits(model(ids, pos, kv, md)[-1:])
    fwd()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fwd()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / steps * 1e6
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd()
        torch.cuda.synchronize()
    rows = kernel_rows(prof, steps)
    total = sum(r["us_per_step"] for r in rows)
    print(f"--- prefill T={t}: eager {eager_us:.0f} us/forward ({t / eager_us * 1e6:.0f} tok/s), kernel time "
          f"{total:.0f} us ({len(model.layers)} layers)")
    for r in rows[:25]:
        print(f"  {r['us_per_step']:8.1f} us/fwd {r['calls_per_step']:6.0f} x {r['us_per_call']:8.2f} us  {r['kernel']}")
    return {"prefill_tokens": t, "eager_us": eager_us, "kernel_us": total, "layers": len(model.layers), "rows": rows}


def main() -> None:
    core, ready = _engine(sys.argv[1], max_model_len=8192, gpu_memory_utilization=0.5)
    print(f"engine ready in {ready:.1f} s")
    res = [profile(core.runner, bs) for bs in (1, 16)]
    res.append(profile_prefill(core.runner))
    Path(sys.argv[2]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
