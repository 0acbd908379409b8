"""The per-expert prefill MoE's host cost (the path below sm80, fused_moe/grouped.py with per_expert_gemm): the
number bench/v100_estimate.py assumes (HOST_MATMUL_S, 10 µs a GEMM) and on which the sorted16 / per-expert
crossover below sm80 rests (BENCHMARKS.md, the V100 section: ~290 tokens at 5 µs, ~500 at 10).

On a CUDA card (the host side is the CPU's and PyTorch's, whatever the GPU), at the served shapes (H 2048, I 768,
128 experts, top 8, g128, fp16):
  * launch: the loop alone (grouped._gmm with host sizes) over 128 experts of 2 rows at K = N = 64, where the GPU
    work is negligible: host µs a GEMM; beside it PyTorch's _grouped_mm (fp16: its C++ fallback loop, one host
    sync a call) on the same operands;
  * moe: grouped.fused_moe(per_expert_gemm=True) at 256 / 512 / 4,096 tokens: the host time until the call returns
    (the GPU idle before it; the call's one sync waits for the routing only) against the wall time with the GPU
    done, per call and per GEMM (3 x active experts).
Medians of REPEAT. Usage: python bench/prefill_moe_host.py OUT.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

REPEAT = 15
H, I, E, TOPK, G = 2048, 768, 128, 8, 128


def _median(fn) -> float:
    times = []
    for _ in range(REPEAT):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times)


def launch() -> dict:
    from onecard.kernels.fused_moe.grouped import _gmm

    sizes = [2] * E
    a = torch.randn(2 * E, 64, dtype=torch.float16, device="cuda")
    b = torch.randn(E, 64, 64, dtype=torch.float16, device="cuda")
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    ref = _gmm(a, b, offs, sizes)
    fallback = getattr(torch, "_grouped_mm", None)
    out = {"loop_us_per_gemm": _median(lambda: _gmm(a, b, offs, sizes)) / E * 1e6}
    if fallback is not None:
        assert torch.allclose(fallback(a, b, offs=offs).float(), ref.float(), atol=1e-2)
        out["grouped_mm_us_per_gemm"] = _median(lambda: fallback(a, b, offs=offs)) / E * 1e6
    return out


def moe(tokens: int, ws) -> dict:
    from onecard.kernels.fused_moe import grouped

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g, device="cuda").half()
    logits = torch.randn(tokens, E, generator=g, device="cuda")
    active = int((torch.bincount(torch.topk(logits, TOPK).indices.flatten(), minlength=E) > 0).sum())

    def call():
        return grouped.fused_moe(x, logits, *ws, TOPK, True, per_expert_gemm=True)

    call()
    host, wall = [], []
    for _ in range(REPEAT):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    h, w = statistics.median(host), statistics.median(wall)
    return {"tokens": tokens, "active_experts": active, "host_ms": h * 1e3, "wall_ms": w * 1e3,
            "host_us_per_gemm": h / (3 * active) * 1e6}


def main(out: str) -> None:
    from kernels_testlib import random_gptq

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "launch": launch()}
    ws = [random_gptq(H, I, G, experts=E, seed=1)[0], random_gptq(H, I, G, experts=E, seed=2)[0],
          random_gptq(I, H, G, experts=E, seed=3)[0]]
    ws = [w.to("cuda") for w in ws]
    res["moe"] = [moe(t, ws) for t in (256, 512, 4096)]
    Path(out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["launch"]))
    print("| tokens | active experts | host ms (until return) | wall ms | host µs a GEMM |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in res["moe"]:
        print(f"| {r['tokens']:,} | {r['active_experts']} | {r['host_ms']:.2f} | {r['wall_ms']:.2f} | "
              f"{r['host_us_per_gemm']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefill_moe_host.json")
