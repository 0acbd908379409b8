"""Decode attention alone at long contexts, swept (issue 25 item 3): what its launch knobs cost against the KV
bytes it reads. No checkpoint: the model's attention shape (32 query / 4 KV heads, head_dim 128, 16-token
blocks, fp16 or fp8_e5m2 KV) on random caches.

Each point is one CUDA graph of LAYERS paged-attention launches (one per layer, each on its own K/V caches,
as the engine's decode graph runs them: decode-only metadata with max_seq_len = the bound 65,536 =
max_model_len, so the split is the bound's and every context replays the same graph; PDL as the engine
decides), replayed REPLAYS times; µs per launch = median replay / LAYERS (attention + the segment reduce).
GB/s = the KV bytes one launch reads (every sequence's K and V at its context) / that time; ``floor_frac`` =
the time those bytes take at the device-to-device copy rate measured in the same run on the same bytes
(read + write counted, as bench/full_size.copy_bandwidth) / the measured time.

Cases: 1 x 512 (short-context control), 1 x 32k, 1 x 64k, 16 x 8k (fp16 KV) and 1 x 32k with fp8_e5m2 KV.
Knobs (kernels/paths.set_decode_attention_override, the one hook; paths.DECODE_ATTN_KNOBS): segments (around
the "fill" policy's choice, its choice at other programs per SM, the legacy count), block_n, num_warps,
num_stages, prefetch (the kernel's own: 1 block-table entries, 2 also K/V, one tile ahead), reduce_block_s /
reduce_warps. Points run in
priority order (the default; segments; reduce; stages x prefetch; tiles; segments again at the best tiles)
until --budget seconds have passed; the rest are listed as skipped. First, --prewarm worker processes compile
every kernel the points need into Triton's cache (a process compiles one kernel at a time). Every point's layer-0 output is compared
with the default's (``max_diff``, relative to its largest value); the default's with the float32 reference (``ref_err``).

Usage (repo root, a GPU): python bench/attn_sweep.py OUT.json [--budget 330]
  (OUT=$OUT bash bench/run_h200.sh attnsweep). Without a GPU: python bench/attn_sweep.py --plan prints the
  cases, their bytes and the knob points that would run; TRITON_INTERPRET=1 python bench/attn_sweep.py --smoke
  OUT.json runs the whole flow on the CPU at tiny contexts (2 layers, 2 points per phase; timings meaningless).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onecard.kernels import paths

HQ, HKV, D, BLOCK = 32, 4, 128, 16
BOUND = 65536                                   # max_model_len: the graph's max_seq_len
LAYERS, REPLAYS = 48, 20
SMS_PLAN = 132                                  # the plan's SM count without a GPU (H100/H200)
CASES = (("1x512", 1, 512, "fp16"), ("1x32k", 1, 32768, "fp16"), ("1x64k", 1, 65536, "fp16"),
         ("16x8k", 16, 8192, "fp16"), ("1x32k-e5m2", 1, 32768, "fp8_e5m2"))
CONTROL = ("1x32k", "16x8k")                    # cases timed again with contiguous block tables
# --smoke (TRITON_INTERPRET=1 on the CPU): the same code at tiny contexts, 2 layers, 2 points per phase
SMOKE_CASES = (("1x512", 1, 40, "fp16"), ("1x32k", 1, 300, "fp16"), ("1x64k", 1, 700, "fp16"),
               ("16x8k", 3, 200, "fp16"), ("1x32k-e5m2", 1, 300, "fp8_e5m2"))
# stages x prefetch at the default tiles, then block_n x num_warps (each at stages 2 with every prefetch level
# and at stages 3), then the reduce
STAGES = (1, 2, 3, 4)
PREFETCH = (0, 1, 2)
TILES = ((32, 4), (32, 8), (64, 8), (128, 4), (128, 8), (64, 2), (32, 2), (16, 4))
SEGMENTS2_RESERVE = 70.0                        # seconds of --budget kept for the segments at the best tiles
REDUCE = ((64, 4), (128, 4), (128, 8), (32, 8), (32, 2))


def kv_bytes(batch: int, ctx: int, kv: str) -> int:
    """K and V bytes one launch reads: every sequence's context, all KV heads."""
    return batch * ctx * HKV * D * 2 * (1 if kv == "fp8_e5m2" else 2)


def fill_segments(batch: int, sms: int, cc: int, **knobs) -> int:
    """The split the table (with ``knobs``' block_n) picks for this launch's bound."""
    paths.set_decode_attention_override(**{k: v for k, v in knobs.items() if k == "block_n"})
    try:
        return paths.split_kv(batch, True, BOUND, HKV, sms, cc)[0]
    finally:
        paths.set_decode_attention_override()


def segment_points(batch: int, sms: int, cc: int, **knobs) -> list[int]:
    """Segment counts around the fill choice: x0.25 .. x2, fill at 1..6 programs per SM, the legacy count."""
    fill = fill_segments(batch, sms, cc, **knobs)
    out = {max(1, min(paths.MAX_SEGMENTS, round(fill * f))) for f in (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2)}
    for per_sm in range(1, 7):
        paths.set_split_kv_policy("fill", ctas_per_sm=per_sm)
        out.add(fill_segments(batch, sms, cc, **knobs))
    paths.set_split_kv_policy("legacy")
    out.add(fill_segments(batch, sms, cc, **knobs))
    paths.set_split_kv_policy(None)
    out.discard(fill)
    return sorted(out)


def tile_points() -> list[dict]:
    pts = [{"num_stages": s, "prefetch": p} for s in STAGES for p in PREFETCH]
    pts = [p for p in pts if p != {"num_stages": paths.ATTN_STAGES, "prefetch": paths.ATTN_PREFETCH}]
    pts += [{"block_n": b, "num_warps": w, "num_stages": s, "prefetch": p} for b, w in TILES
            for s, p in [(2, p) for p in PREFETCH] + [(3, 0)]]
    return pts


class Case:
    """LAYERS (k, v) caches for ``batch`` sequences of ``ctx`` tokens, graph-shaped metadata, a query."""

    def __init__(self, name: str, batch: int, ctx: int, kv: str, dev: torch.device, layers: int | None = None):
        from onecard.kernels.attention.metadata import AttentionMetadata

        self.name, self.batch, self.ctx, self.kv = name, batch, ctx, kv
        nblk = -(-ctx // BLOCK)
        nb = batch * nblk + 1
        dt = torch.float8_e5m2 if kv == "fp8_e5m2" else torch.float16
        g = torch.Generator(device=dev).manual_seed(0)
        self.caches = []
        for _ in range(layers or LAYERS):
            pair = []
            for _ in range(2):
                c = torch.empty(nb, BLOCK, HKV, D, dtype=torch.float16, device=dev).normal_(generator=g)
                pair.append(c.to(dt) if dt != torch.float16 else c)
            self.caches.append(tuple(pair))
        width = BOUND // BLOCK
        order = torch.randperm(batch * nblk, device=dev, generator=g)
        table = torch.zeros(batch, width, dtype=torch.int32, device=dev)
        table[:, :nblk] = order.view(batch, nblk).to(torch.int32)       # the engine: scattered free blocks
        self.q = torch.randn(batch, HQ, D, device=dev, generator=g).to(torch.float16)
        self.md = AttentionMetadata(slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=dev),
                                    query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
                                    seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
                                    block_table=table, max_query_len=1, max_seq_len=BOUND, num_decode_tokens=batch)
        self.bytes = kv_bytes(batch, ctx, kv)
        self.copy_rate = copy_rate(self.caches, self.bytes) if layers is None else 0.0

    def launch(self) -> list[torch.Tensor]:
        from onecard.kernels.attention import triton as tk

        return [tk.paged_attention(self.q, k, v, self.md, 1 / math.sqrt(D)) for k, v in self.caches]

    def ref_err(self, out: torch.Tensor) -> float:
        from onecard.kernels.attention import ref

        want = ref.paged_attention(self.q.float(), *self.caches[0], self.md, 1 / math.sqrt(D))
        return float((out.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def copy_rate(caches, nbytes: int) -> float:
    """Device-to-device copy rate (read + write bytes / s) over ``nbytes`` of every layer's caches (the bytes
    a launch reads, LAYERS times, as the graph reads them)."""
    per = nbytes // 2
    src = [c.view(torch.uint8).view(-1)[:per] for pair in caches for c in pair]
    dst = [torch.empty_like(s) for s in src[:2]]

    def copy() -> None:
        for i, s in enumerate(src):
            dst[i % 2].copy_(s)

    cuda = src[0].device.type == "cuda"
    step = copy
    if cuda:                                                             # one graph: no launch gaps, as attention
        copy()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            copy()
        step = g.replay
    times = [timed(step, cuda) for _ in range(5)][2:]
    return 2 * per * len(src) / statistics.median(times)


def timed(fn, cuda: bool) -> float:
    """Seconds ``fn()`` takes on the device (CUDA events) or the host (the CPU smoke run)."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    fn()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / 1e3


def measure(case: Case, knobs: dict, ref: torch.Tensor | None) -> dict:
    """One point: capture the LAYERS launches under ``knobs``, replay, time; layer 0's output vs ``ref``.
    (CPU smoke run: eager launches, host time.)"""
    from onecard.kernels.attention import triton as tk

    cuda = case.q.device.type == "cuda"
    paths.set_decode_attention_override(**knobs)
    try:
        plan = tk.launch_plan(case.md, HQ, HKV, case.q.device)
        outs = case.launch()                                             # JIT compile outside the capture
        if cuda:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = case.launch()
            step = g.replay
        else:
            step = case.launch
    finally:
        paths.set_decode_attention_override()
    warm = 2 if cuda else 0
    times = [timed(step, cuda) * 1e6 / LAYERS for _ in range(REPLAYS + warm)][warm:]
    us = statistics.median(times)
    floor_us = case.bytes / case.copy_rate * 1e6
    row = {"case": case.name, "knobs": knobs, "plan": plan._asdict(), "us": us, "us_min": min(times),
           "gb_s": case.bytes / us / 1e3, "floor_us": floor_us, "floor_frac": floor_us / us,
           "out0": outs[0].clone()}
    if ref is not None:                                                  # relative to the default's largest output
        row["max_diff"] = float((outs[0].float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    return row


def _prewarm(job: tuple[dict, int, str, str]) -> str | None:
    """Worker process: compile the kernels of one knob set for one (batch, KV dtype) into Triton's on-disk cache
    (a 16-token context: the same specialization as the real cases), so the sweep's own launches load them."""
    knobs, batch, kv, dev = job
    try:
        c = Case("warm", batch, BLOCK, kv, torch.device(dev), layers=1)
        paths.set_decode_attention_override(**knobs)
        c.launch()
        if dev == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:                                               # the sweep compiles (and reports) it
        return f"{knobs} bs{batch} {kv}: {type(e).__name__}: {str(e)[:200]}"


def prewarm(points: list[tuple[str, str, dict]], workers: int, dev: str = "cuda") -> tuple[int, list[str]]:
    """Compile every kernel the points need, ``workers`` processes at once (Triton compiles one at a time per
    process). -> (jobs, errors)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    spec = {c[0]: (c[1], c[3]) for c in CASES}
    jobs = {}
    for _phase, name, knobs in points:
        k = {a: b for a, b in knobs.items() if a not in ("segments", "min_seg_tiles")}
        b, kv = spec[name]
        jobs[json.dumps([k, min(b, 2), kv], sort_keys=True)] = (k, b, kv, dev)   # PDL: batch 1 vs the rest
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            errors = [e for e in pool.map(_prewarm, list(jobs.values())) if e]
    except Exception as e:                                               # a worker died: the sweep compiles itself
        errors = [f"prewarm stopped: {type(e).__name__}: {str(e)[:300]}"]
    return len(jobs), errors


def plan_points(cc: int, sms: int) -> list[tuple[str, str, dict]]:
    """(phase, case, knobs) in priority order (phase 'segments2' is filled in after the tiles are known)."""
    pts: list[tuple[str, str, dict]] = []
    for name, b, _ctx, _kv in CASES:
        pts += [("segments", name, {"segments": s}) for s in segment_points(b, sms, cc)]
    fp16 = [c[0] for c in CASES if c[3] == "fp16"]
    pts += [("reduce", n, {"reduce_block_s": s, "reduce_warps": w}) for s, w in REDUCE for n in fp16]
    for k in tile_points():
        pts += [("tiles", c[0], k) for c in CASES if c[3] == "fp16" or "block_n" not in k or k["num_stages"] == 2]
    return pts


def summary(rows: list[dict], defaults: dict[str, dict]) -> list[str]:
    head = f"{'case':<12} {'default us':>10} {'GB/s':>7} {'floor':>6}   {'best us':>8} {'GB/s':>7} {'floor':>6}"
    lines = [head + "  best knobs (plan)"]
    for name, *_ in CASES:
        d = defaults.get(name)
        mine = [r for r in rows if r["case"] == name and "us" in r and r["phase"] != "contiguous-blocks"]
        if not d or not mine:
            continue
        b = min(mine, key=lambda r: r["us"])
        p = b["plan"]
        lines.append(f"{name:<12} {d['us']:>10.1f} {d['gb_s']:>7.0f} {d['floor_frac']:>6.0%}   {b['us']:>8.1f} "
                     f"{b['gb_s']:>7.0f} {b['floor_frac']:>6.0%}  {b['knobs']} (segs {p['segments']}, "
                     f"BN {p['block_n']}, w {p['num_warps']}, st {p['num_stages']}, pf {p['prefetch']}, "
                     f"red {p['reduce_block_s']}/{p['reduce_warps']})")
    lines.append("best of each group, time / the default's (segments at the default tiles; prefetch levels at any "
                 "tiles; contiguous = the same launch on a contiguous block table):")
    groups = {"segments": lambda r: r["phase"] == "segments", "reduce": lambda r: r["phase"] == "reduce",
              "pf0-tiles": lambda r: r["phase"] in ("tiles", "segments2") and r["plan"]["prefetch"] == 0,
              "pf1": lambda r: r["plan"]["prefetch"] == 1, "pf2": lambda r: r["plan"]["prefetch"] == 2,
              "contiguous": lambda r: r["phase"] == "contiguous-blocks"}
    for name, *_ in CASES:
        d = defaults.get(name)
        mine = [r for r in rows if r["case"] == name and "us" in r]
        if not d or not mine:
            continue
        parts = []
        for g, keep in groups.items():
            sel = [r for r in mine if keep(r)]
            if sel:
                b = min(sel, key=lambda r: r["us"])
                k = {a: v for a, v in b["knobs"].items() if a != "prefetch"}
                parts.append(f"{g} {b['us'] / d['us']:.2f}x{' ' + str(k) if k else ''}")
        lines.append(f"  {name}: " + "; ".join(parts))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for the points (priority order)")
    ap.add_argument("--plan", action="store_true", help="print the cases and points only (no GPU needed)")
    ap.add_argument("--prewarm", type=int, default=8, help="processes compiling the kernels first (0: none)")
    ap.add_argument("--smoke", action="store_true", help="CPU, under TRITON_INTERPRET=1: tiny contexts, few points")
    a = ap.parse_args()
    t_start = time.perf_counter()
    global CASES, LAYERS, REPLAYS, BOUND
    if a.smoke:
        CASES, LAYERS, REPLAYS, BOUND = SMOKE_CASES, 2, 1, 4096
    elif a.plan or not torch.cuda.is_available():
        cc, sms = 90, SMS_PLAN
        for name, b, ctx, kv in CASES:
            print(f"{name}: {kv_bytes(b, ctx, kv) / 1e6:.1f} MB of KV per launch, fill "
                  f"{fill_segments(b, sms, cc)} segments at {sms} SMs; segment points {segment_points(b, sms, cc)}")
        pts = plan_points(cc, sms)
        print(f"{len(pts)} points after the {len(CASES)} defaults (+ block-table controls); phases:",
              {ph: sum(p[0] == ph for p in pts) for ph in ("segments", "reduce", "tiles")})
        return
    assert a.out, "OUT.json"
    dev = torch.device("cpu" if a.smoke else "cuda")
    from onecard.kernels.triton_common import compute_capability, num_sms

    cc, sms = compute_capability(dev), num_sms(dev)
    info = {"device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(), "sms": sms, "cc": cc,
            "torch": torch.__version__, "layers": LAYERS, "replays": REPLAYS, "bound": BOUND, "block_size": BLOCK}
    import triton

    info["triton"] = triton.__version__
    points = plan_points(cc, sms)
    if a.smoke:
        points = [p for ph in ("segments", "reduce", "tiles") for p in [q for q in points if q[0] == ph][:2]]
    if a.prewarm:
        n, errors = prewarm([("default", c[0], {}) for c in CASES] + points, a.prewarm if not a.smoke else 2,
                            dev.type)
        info["prewarm"] = {"jobs": n, "seconds": time.perf_counter() - t_start, "errors": errors}
        print(f"prewarm: {n} compiles in {info['prewarm']['seconds']:.0f} s, {len(errors)} errors", flush=True)
    cases = {c[0]: Case(*c, dev) for c in CASES}
    info["copy_rate_tb_s"] = {n: c.copy_rate / 1e12 for n, c in cases.items()}
    rows: list[dict] = []
    defaults: dict[str, dict] = {}
    result = {"info": info, "defaults": defaults, "rows": rows, "skipped": []}

    def save() -> None:
        strip = [{k: v for k, v in r.items() if k != "out0"} for r in rows]
        Path(a.out).write_text(json.dumps({**result, "rows": strip,
                                           "defaults": {k: {kk: vv for kk, vv in v.items() if kk != "out0"}
                                                        for k, v in defaults.items()}}, indent=1))

    def run(phase: str, name: str, knobs: dict, compare: bool = True) -> dict | None:
        if time.perf_counter() - t_start > a.budget - (0 if phase == "segments2" else SEGMENTS2_RESERVE):
            result["skipped"].append({"phase": phase, "case": name, "knobs": knobs})
            return None
        try:
            r = measure(cases[name], knobs, defaults[name]["out0"] if compare and name in defaults else None)
        except Exception as e:                                           # e.g. out of shared memory: record it
            r = {"case": name, "knobs": knobs, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if dev.type == "cuda":
                torch.cuda.synchronize()
        r["phase"] = phase
        rows.append(r)
        if len(rows) % 10 == 0 and dev.type == "cuda":                 # captured graphs' pools: give them back
            gc.collect()
            torch.cuda.empty_cache()
        return r

    for name, c in cases.items():                                        # the default, and the reference check
        d = run("default", name, {})
        if "error" in d:
            print(f"{name}: default failed: {d['error']}", flush=True)
            continue
        d["ref_err"] = c.ref_err(d["out0"])
        defaults[name] = d
        print(f"{name}: default {d['us']:.1f} us/launch, {d['gb_s']:.0f} GB/s, {d['floor_frac']:.0%} of the copy "
              f"floor, segments {d['plan']['segments']}, ref err {d['ref_err']:.2e}", flush=True)
    for name in CONTROL:                                                 # block-table layout control
        c = cases[name]
        table = c.md.block_table.clone()
        nblk = -(-c.ctx // BLOCK)
        c.md.block_table[:, :nblk] = torch.arange(c.batch * nblk, device=dev, dtype=torch.int32).view(c.batch, nblk)
        run("contiguous-blocks", name, {}, compare=False)                # other blocks: other values
        c.md.block_table.copy_(table)
    save()
    for phase, name, knobs in points:
        run(phase, name, knobs)
        if len(rows) % 10 == 0:
            save()
    for name, c in cases.items():                                        # segments again at the 2 best tiles
        tiles = sorted((r for r in rows if r["case"] == name and "us" in r and r["phase"] == "tiles"),
                       key=lambda r: r["us"])[:2]
        for t in tiles:
            segs = segment_points(c.batch, sms, cc, **t["knobs"]) + [fill_segments(c.batch, sms, cc, **t["knobs"])]
            for s in segs[:1] if a.smoke else segs:
                run("segments2", name, {**t["knobs"], "segments": s})
    info["seconds"] = time.perf_counter() - t_start
    save()
    errs = [r for r in rows if "error" in r]
    bad = [r for r in rows if r.get("max_diff", 0) > 1e-2]
    print("\n".join(summary(rows, defaults)))
    print(f"{len(rows)} points, {len(errs)} errors, {len(bad)} with layer-0 output off the default's by > 1e-2, "
          f"{len(result['skipped'])} skipped (budget), {info['seconds']:.0f} s; copy rate "
          + ", ".join(f"{n} {v:.2f}" for n, v in info["copy_rate_tb_s"].items()) + " TB/s")
    for r in bad[:5]:
        print("  off:", r["case"], r["knobs"], r["max_diff"])


if __name__ == "__main__":
    main()
