"""Decode-kernel sweep on the GPU: block configurations of the small-M W4A16 GEMM at the real shapes, timed
under CUDA-graph replay with the weights ROTATED over enough copies that nothing stays in L2 (what a
decode step sees: every weight is read once). Also the floor terms: an empty Triton kernel per graph node and
a device copy of the same bytes.

Also the decode fused MoE (T = 1 and 16) over its block configurations.

Usage (on the GPU, repo root): python bench/tune_decode.py OUT.json [gemm|gemv|skinny] [moe|moe1|moe16]
"""
from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels_gpu import rand_gptq
from onecard.kernels.gptq_gemm import triton as g_t

DEV = torch.device("cuda")
COPIES = 24                                   # 24 x 5 MB > 50 MB L2


def graph_us(fns) -> float:
    """µs per call: one graph holding every fn in ``fns`` (each reading different memory), replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (10 * len(fns))


@triton.jit
def _empty_kernel(x_ptr):
    pass


def best_rows(rows, **key) -> list[dict]:
    sel = [r for r in rows if all(r.get(k) == v for k, v in key.items()) and r["cfg"] != "production"]
    return sorted(sel, key=lambda r: r["us"])[:5]


def sweep_gemm(res: dict, rows: list, parts: list[str]) -> None:
    for name, k, n in (("qkv", 2048, 5120), ("o_proj", 4096, 2048)):
        ws = [rand_gptq(k, n) for _ in range(COPIES)]
        nbytes = ws[0].nbytes()
        srcs = [w.qweight for w in ws]
        dsts = [torch.empty_like(s) for s in srcs]
        cp = graph_us([lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)])
        print(f"{name}: copy of the qweight bytes {cp:.2f} us ({2 * srcs[0].numel() * 4 / cp / 1e3:.0f} GB/s r+w)")
        res[f"{name}_copy_us"] = cp
        grids = []
        if "gemv" in parts:
            grids.append((1, itertools.product((32, 64, 128), (16, 32), (2, 4), (2,), (4, 8, 16))))
        if "skinny" in parts:   # few programs per SM (0 = one split: no memset, no reduce launch)
            grids.append((16, itertools.product((32, 64, 128), (16,), (2, 4), (2, 3, 4), (0, 1, 2, 4, 12))))
        for m, grid in grids:
            x = torch.randn(m, k, device=DEV, dtype=torch.float16) / math.sqrt(k)
            ref = torch.matmul(x.float(), g_t.dequantize(ws[0], torch.float32))
            prod = graph_us([lambda w=w, x=x: g_t.w4a16_gemm(x, w) for w in ws])
            print(f"{name} M={m}: production {prod:.2f} us ({nbytes / prod / 1e3:.0f} GB/s)")
            rows.append(dict(op=name, m=m, cfg="production", us=prod))
            for cfg in grid:
                if cfg[1] * 8 > 128 and k % (cfg[1] * 8):
                    continue
                try:
                    y = g_t.small_m_gemm(x, ws[0], tuning=cfg)
                    err = float((y.float() - ref).norm() / ref.norm())
                    us = graph_us([lambda w=w, x=x, cfg=cfg: g_t.small_m_gemm(x, w, tuning=cfg) for w in ws])
                except Exception as e:
                    print(f"  {cfg}: {type(e).__name__}")
                    continue
                rows.append(dict(op=name, m=m, cfg=list(cfg), us=us, rel_err=err))
            for r in best_rows(rows, op=name, m=m):
                print(f"  best {r['cfg']}: {r['us']:.2f} us (err {r['rel_err']:.1e})")


def sweep_moe(rows: list, parts: list[str]) -> None:
    """Decode MoE (route + gate/up + down + finish) at T = 1 and 16, 4 weight copies x 2 routings each."""
    from bench.kernels_gpu import TOPK, E, H, I
    from onecard.kernels.fused_moe import decode as md
    from onecard.kernels.fused_moe import ref as moe_r
    layers = [tuple(rand_gptq(k, n, E) for k, n in ((H, I), (H, I), (I, H))) for _ in range(4)]
    grids = []
    if "moe1" in parts:
        grids.append((1, itertools.product((32, 64), (16, 32), (2, 4), (2, 3), (8, 16, 24))))
    if "moe16" in parts:
        grids.append((16, itertools.product((64, 128), (16,), (2, 4), (2, 3), (4, 8, 12, 16, 24))))
    for t, grid in grids:
        x = torch.randn(t, H, device=DEV, dtype=torch.float16)
        logits = [torch.randn(t, E, device=DEV, dtype=torch.float16) for _ in range(2 * len(layers))]
        calls = [(lw, lg) for lw, lg in zip(layers * 2, logits)]
        wg, wu, wd = layers[0]
        ref = moe_r.fused_moe(x, logits[0], wg, wu, wd, TOPK, True).float()
        prod = graph_us([lambda c=c, x=x: md.fused_moe_decode(x, c[1], *c[0], TOPK, True) for c in calls])
        print(f"moe T={t}: production {prod:.2f} us")
        rows.append(dict(op="moe", m=t, cfg="production", us=prod))
        for cfg in grid:
            try:
                y = md.fused_moe_decode(x, logits[0], wg, wu, wd, TOPK, True, tuning=cfg)
                err = float((y.float() - ref).norm() / ref.norm())
                us = graph_us([lambda c=c, x=x, cfg=cfg: md.fused_moe_decode(x, c[1], *c[0], TOPK, True, tuning=cfg)
                               for c in calls])
            except Exception as e:
                print(f"  {cfg}: {type(e).__name__}")
                continue
            rows.append(dict(op="moe", m=t, cfg=list(cfg), us=us, rel_err=err))
        for r in best_rows(rows, op="moe", m=t):
            print(f"  best {r['cfg']}: {r['us']:.2f} us (err {r['rel_err']:.1e})")


def main() -> None:
    res: dict = {}
    x0 = torch.zeros(1, device=DEV)
    res["empty_kernel_node_us"] = graph_us([lambda: _empty_kernel[(1,)](x0)] * 50)
    print(f"empty kernel per graph node: {res['empty_kernel_node_us']:.2f} us")
    rows: list = []
    parts = sys.argv[2:] or ["gemm", "moe"]
    parts = parts + (["gemv", "skinny"] if "gemm" in parts else []) + (["moe1", "moe16"] if "moe" in parts else [])
    if {"gemv", "skinny"} & set(parts):
        sweep_gemm(res, rows, parts)
    if {"moe1", "moe16"} & set(parts):
        sweep_moe(rows, parts)
    res["rows"] = rows
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
