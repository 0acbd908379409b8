"""Would batch-1 decode at long contexts gain from the next layer's KV streamed into L2 ahead of its attention?
The premise of paths.BATCH1_KV_PREFETCH (issue 25 item 3), alone: one layer's decode attention at the served
shape (32 q / 4 KV heads, D 128, 16-token blocks, shuffled block table, graphs' bound 65,536: the shipped split)
over one sequence of CTX keys, timed inside CUDA graphs after the L2 was flushed, with and without part of its KV
read into L2 first.

Why: at 32k the batch-1 step is the 512-token step plus its 3.2 GB of KV read at ~98% of the copy rate
(BENCHMARKS.md): the attention is bandwidth-bound while the rest of a layer (GEMVs, the MoE slices) is latency-bound
and leaves the HBM mostly idle. Read during the previous layer's MoE, the first share of a layer's 67 MB of KV could
come from the 50 MB L2 instead. The attention's programs all run in one wave and share the bandwidth, so its time
should fall with the bytes left in HBM, if the lines survive in L2 until it runs.

Scenarios (each a sequence captured COPIES times in one graph; the attention's time is the sequence's minus the same
sequence without the attention, medians over ROUNDS; the flush rewrites a buffer of 4 x the L2):
  cold                  flush, attention
  pf{X}_{policy}        flush, the first X of the KV's positions read by attention/triton.kv_touch (the
                        kernel paths.BATCH1_KV_PREFETCH runs; loads with Triton's eviction policy ``evict_last``,
                        or the default), attention
  pf{X}_{policy}_stream the same with STREAM_MB of other data read between (the MoE's and the GEMVs' weights of a
                        layer, ~19 + 10 MB, which run between the prefetch and the attention in the model)
and ``touch{X}_us``: the read of X alone after a flush (what it would cost serially). Then as the model would run
it, the net figure:
  chain                 flush, the batch-1 MoE block (fused_moe norm_moe at T = 1: the shipped slices, random
                        GPTQ experts at the served shape), attention
  chain_pf{X}           flush, the MoE block with the touch of X (evict_last) on a side stream beside it (forked
                        before, joined after), attention
each minus the flush alone: ``chain_pf{X}_saves_us`` = chain - chain_pf{X} is what a layer would gain (the MoE's
own slowdown from the touch's reads included). Writes OUT (JSON) and prints one line per scenario.

Usage (a GPU): python bench/kv_l2_probe.py OUT.json [--ctx 32768,65536]
The touch kernel's own check: interpret_cases.py's kvtouch cases (CPU), tests/gpu/test_kv_prefetch_gpu.py.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

HQ, HKV, D, BLOCK = 32, 4, 128, 16
BOUND = 65536                    # the served max_model_len: the CUDA graphs' split
FRACTIONS = (0.25, 0.4, 0.6)
STREAM_MB = 29
COPIES, REPLAYS, ROUNDS = 8, 10, 5


def _median_us(fn) -> float:
    from kernels_gpu import bench_graph

    return statistics.median(bench_graph(fn, COPIES, REPLAYS) for _ in range(ROUNDS))


def probe(ctx: int) -> dict:
    from kernels_gpu import TOPK, E, H, I, rand_gptq
    from kernels_testlib import make_paged_batch

    from onecard.kernels.attention import triton as at_t
    from onecard.kernels.fused_moe import triton as moe_t
    from onecard.kernels.triton_common import set_pdl

    set_pdl(1)                                                            # as the runner does (ONECARD_PDL_MAX_TOKENS)
    dev = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)   # H100 / H200: 50 MB
    kc, vc, md, _, _ = make_paged_batch([ctx], [1], HKV, D, BLOCK, dtype=torch.float16)
    kc, vc = kc.to(dev), vc.to(dev)
    md = type(md)(md.slot_mapping.to(dev), md.query_start_loc.to(dev), md.seq_lens.to(dev),
                  md.block_table.to(dev), 1, BOUND, 1)
    q = torch.randn(1, HQ, D, device=dev, dtype=torch.float16)
    flush = torch.zeros(l2, dtype=torch.float32, device=dev)               # 4 bytes each: 4 x the L2, rewritten
    stream = torch.ones(STREAM_MB * 2**20 // 2, dtype=torch.float16, device=dev)
    sink = torch.empty(ctx, dtype=torch.float32, device=dev)             # >= a sum per chunk
    kv_bytes = 2 * ctx * HKV * D * 2
    wg, wu, wd = rand_gptq(H, I, E), rand_gptq(H, I, E), rand_gptq(I, H, E)
    wr = (torch.randn(E, H, device=dev) / H ** 0.5).half()
    x, res = torch.randn(1, H, device=dev).half(), torch.randn(1, H, device=dev).half()
    nw = (1 + 0.1 * torch.randn(H, device=dev)).half()
    aux = torch.cuda.Stream(dev)

    def chain(frac: float, attend: bool):
        def run():
            flush.add_(1.0)
            if frac:
                cur = torch.cuda.current_stream()
                aux.wait_stream(cur)                                      # fork after the flush
                with torch.cuda.stream(aux):
                    at_t.kv_touch(kc, vc, md, int(frac * ctx), sink)
            moe_t.norm_moe(x, res, nw, 1e-6, wr, wg, wu, wd, TOPK, True)
            if frac:
                torch.cuda.current_stream().wait_stream(aux)              # join before the attention
            if attend:
                at_t.paged_attention(q, kc, vc, md, D ** -0.5)
        return run

    def seq(frac: float, last: bool, streamed: bool, attend: bool):
        def run():
            flush.add_(1.0)
            if frac:
                at_t.kv_touch(kc, vc, md, int(frac * ctx), sink, evict_last=last)
            if streamed:
                stream.sum()
            if attend:
                at_t.paged_attention(q, kc, vc, md, D ** -0.5)
        return run

    base_cold = _median_us(seq(0.0, False, False, False))
    out = {"ctx": ctx, "kv_mb": kv_bytes / 2**20, "l2_mb": l2 / 2**20, "stream_mb": STREAM_MB,
           "segments": at_t.split_plan(md, HKV, dev)[0]}
    cold = _median_us(seq(0.0, False, False, True)) - base_cold
    out["cold_us"] = cold
    print(f"ctx {ctx}: KV {out['kv_mb']:.0f} MB, L2 {out['l2_mb']:.0f} MB, {out['segments']} segments: "
          f"attention cold {cold:.1f} us ({kv_bytes / cold / 1e6:.0f} GB/s)", flush=True)
    for frac in FRACTIONS:
        touch = _median_us(seq(frac, True, False, False)) - base_cold
        out[f"touch{frac}_us"] = touch
        for last in (True, False):
            for streamed in (False, True):
                name = f"pf{frac}_{'last' if last else 'normal'}{'_stream' if streamed else ''}"
                without = _median_us(seq(frac, last, streamed, False))
                t = _median_us(seq(frac, last, streamed, True)) - without
                out[name + "_us"] = t
                print(f"  {name}: attention {t:.1f} us (saves {cold - t:.1f}; the touch alone {touch:.1f} us)",
                      flush=True)
    out["moe_us"] = _median_us(chain(0.0, False)) - base_cold
    out["chain_us"] = _median_us(chain(0.0, True)) - base_cold
    print(f"  chain (MoE block {out['moe_us']:.1f} us, then attention): {out['chain_us']:.1f} us", flush=True)
    for frac in FRACTIONS:
        t = _median_us(chain(frac, True)) - base_cold
        moe = _median_us(chain(frac, False)) - base_cold
        out[f"chain_pf{frac}_us"], out[f"chain_pf{frac}_moe_us"] = t, moe
        out[f"chain_pf{frac}_saves_us"] = out["chain_us"] - t
        print(f"  chain_pf{frac}: {t:.1f} us (saves {out['chain_us'] - t:.1f}; the MoE with the touch beside it "
              f"{moe:.1f} us)", flush=True)
    return out


def main() -> None:
    path = sys.argv[1]
    ctxs = [int(c) for c in sys.argv[sys.argv.index("--ctx") + 1].split(",")] if "--ctx" in sys.argv else [32768]
    res = {"device": torch.cuda.get_device_name(), "runs": [probe(c) for c in ctxs]}
    Path(path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
