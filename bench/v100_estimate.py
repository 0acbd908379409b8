"""A V100 estimate on paper (issue 25 item 5): each kernel of a batch-1 and a batch-16 decode step (512-token
contexts, as measured on the H200) and of a 4,096-token prefill, on the paths onecard takes on sm70
(kernels/paths.py at cc 70), with its bytes and FLOPs and the time they imply at V100 rates, next to the
H200's measured time of the same kernel where BENCHMARKS.md has one.

Model (every figure an assumption written here, so that it can be argued with and rerun):
  * rates: HBM 750 GB/s achievable; Triton kernels (tl.dot is FMA code on sm70) 15.7 TFLOP/s fp32 FMA; cuBLAS
    fp16 GEMMs 100 TFLOP/s on tensor cores; SDPA's memory-efficient attention (the prefill attention below sm80,
    paths.prefill_sdpa) 50 TFLOP/s on tensor cores (half the GEMMs' rate: its softmax runs on the CUDA cores);
    int4 dequantization 4 integer/convert ops per weight element, issued at the FMA pipe's instruction rate
    (7.85 T instr/s = 15.7 TFLOP/s / 2);
  * the decode MoE at batch > 1 (fused_moe/stages.py, decode16-pre-sm80) by its sm70 SASS instead: the K loop's
    opcodes (bench/sass_report.inner_loop_mix, compiled here) cost max(issue: one warp-instruction a cycle per
    scheduler, 4 a SM; FP32-pipe ops (F*, H*2, IMAD) 2 cycles a warp on its 16 lanes; ALU ops likewise) per
    warp and weight tile, times the tiles of the distinct experts, times the passes over each expert's tokens
    (the 16-row dot: one; the row step, paths.decode_rows: ceil(n / 2) for its n tokens, n binomial under
    uniform routing) at 1.53 GHz on 80 SMs. (FLOPs undercount that kernel: its dot multiplies 16 rows however
    few tokens chose the expert);
  * roofline time = max(bytes / bandwidth, compute / rate);
  * "bound" = max(roofline, H200 measured): the decode kernels are latency-bound on the H200 (3-10x their
    bytes' time, BENCHMARKS.md) and a V100 (1.53 GHz vs 1.98, 80 SMs vs 132, HBM2 latency) is no faster on
    latency, so the H200 time is a floor for the V100's; where no H200 figure exists, the roofline;
  * "H200-efficiency" = V100 roofline x (H200 measured / H200 roofline at 4.3 TB/s and the H200's rates): the
    pessimistic case in which a kernel reaches the same fraction of the V100's roofline as of the H200's;
  * the per-expert prefill MoE (below sm80) issues one torch.matmul per (expert with tokens, projection) from
    Python: 3 x 128 per layer at 4k tokens, ~10 us of host time each (eager PyTorch dispatch; assumed), and
    one host sync per layer.
H200 times: T1 profile (2026-12-04, 8 layers in a CUDA graph, batch 1) and run I (2026-12-03, batch 16 and
the 4k prefill), per layer. Host time of the engine between steps is not included (H200: 131 us at bs1).
Usage: python bench/v100_estimate.py [OUT.json]   (CPU; prints the tables BENCHMARKS.md carries)
"""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from full_size import NKV, NQ, TOPK, D, E, G, H, I, L, V, gptq_bytes
from sass_report import compile_config, inner_loop_mix

from onecard.core.spec.cost import expected_distinct_experts
from onecard.kernels import paths

V100 = {"bw": 750e9, "fma": 15.7e12, "tc": 100e12, "sdpa": 50e12}
H200 = {"bw": 4.3e12, "fma": 67e12, "tc": 750e12, "sdpa": 375e12}   # copy bandwidth measured; fp32 FMA spec;
                                                                    # bf16 matmul measured; sdpa: half of it
DEQUANT_OPS = 4                                       # per weight element (shift, mask, subtract, convert; scale FMA)
HOST_MATMUL_S = 10e-6                                 # one eager torch.matmul launch (assumed)
CTX = 512
V100_SMS, GRAPH_BOUND = 80, 65536   # split-KV segments: a V100's SMs; the CUDA graphs' bound (max_model_len)
PREFILL = 4096


@dataclass
class Kernel:
    name: str
    count: int                 # launches per step (per layer x layers, or once)
    bytes: float               # per launch
    flops: float               # per launch, at the kernel's rate
    unit: str                  # "fma" (Triton on sm70) | "tc" (cuBLAS tensor cores) | "sdpa" (its attention)
    dequant: float = 0.0       # weight elements dequantized per launch
    h200_us: float | None = None   # measured per launch
    host_s: float = 0.0        # host time per launch that the GPU waits for (per-expert loop)
    v100_compute_s: float | None = None   # compute time on the V100 from the kernel's SASS (decode MoE, bs > 1)

    def parts(self, dev: dict) -> dict[str, float]:
        """Seconds per launch that bytes, compute (FLOPs plus dequantization) and host launches each need."""
        compute = self.flops / dev[self.unit] + self.dequant * DEQUANT_OPS * 2 / dev["fma"]
        if dev is V100 and self.v100_compute_s is not None:
            compute = self.v100_compute_s
        return {"bytes": self.bytes / dev["bw"], "compute": compute, "host": self.host_s}

    def roofline(self, dev: dict) -> float:
        return max(self.parts(dev).values())

    def row(self) -> dict:
        parts = self.parts(V100)
        r = max(parts.values())
        bound = max(r, (self.h200_us or 0) * 1e-6)
        eff = r * (self.h200_us * 1e-6 / self.roofline(H200)) if self.h200_us else r
        return {"kernel": self.name, "count": self.count, "mb": self.bytes / 1e6, "gflop": self.flops / 1e9,
                "unit": self.unit, "v100_roofline_us": r * 1e6, "h200_us": self.h200_us,
                "v100_bound_us": bound * 1e6, "v100_h200eff_us": max(eff, bound) * 1e6,
                "limit": max(parts, key=parts.get)}


def gemm(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def split_launch(bs: int, ctx: int, sms: int, cc: int) -> dict:
    """The split-KV launch of the decode graph's attention (paths.split_kv under its default policy, "fill", at
    the graph's bound) for ``bs`` sequences of ``ctx`` tokens on ``sms`` SMs of capability ``cc``: segments per
    (sequence, KV head), the key tiles of each, programs launched and those with keys (the kernel cuts each
    context into ceil(tiles / segments)-tile segments; the rest exit at once), one wave of resident programs
    (paths.split_kv_ctas_per_sm x SMs), the waves the working programs take, and the reduce's bytes (fp32
    partials of every filled segment and query head, read once)."""
    segs, min_tiles = paths.split_kv(bs, True, GRAPH_BOUND, NKV, sms, cc)
    block_n = paths.attention_tiles(cc, 16)[0]
    tiles = -(-ctx // block_n)
    per_seg = max(-(-tiles // segs), min_tiles)
    filled = -(-tiles // per_seg)
    wave = paths.split_kv_ctas_per_sm(cc) * sms
    working = bs * NKV * filled
    return {"bs": bs, "ctx": ctx, "sms": sms, "cc": cc, "block_n": block_n, "segments": segs,
            "tiles_per_segment": per_seg, "filled": filled, "programs": bs * NKV * segs, "working": working,
            "wave": wave, "waves": -(-working // wave), "kv_mb": bs * ctx * 2 * NKV * D * 2 / 1e6,
            "reduce_mb": bs * NQ * filled * D * 4 / 1e6 if segs > 1 else 0.0}


V100_CLOCK, V100_SCHEDULERS = 1.53e9, 4
FP_PIPE = ("FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "HADD2", "HMUL2", "HFMA2", "IMAD")
ALU_PIPE = ("LOP3", "SHF", "IADD3", "LEA", "ISETP", "PRMT", "SEL", "MOV", "PLOP3", "IABS", "I2F", "F2I")


def loop_cycles(mix: dict[str, int]) -> int:
    """Cycles a warp's pass of one K-loop iteration holds its scheduler (the pipe model in the docstring)."""
    fp = sum(n for op, n in mix.items() if op in FP_PIPE)
    alu = sum(n for op, n in mix.items() if op in ALU_PIPE)
    return max(sum(mix.values()), 2 * fp, 2 * alu)


def routed_pmf(tokens: int) -> list[float]:
    """P(n) for an expert's n of ``tokens`` tokens, n ~ Binomial(tokens, TOPK / E) (uniform routing); by the
    ratio of successive terms, so that thousands of tokens do not overflow."""
    p = TOPK / E
    pmf = [(1 - p) ** tokens]
    for n in range(1, tokens + 1):
        pmf.append(pmf[-1] * (tokens - n + 1) / n * p / (1 - p))
    return pmf


def expected_passes(bs: int, rows: int) -> float:
    """E[ceil(n / rows) | n >= 1] for an expert's n tokens of ``bs`` (routed_pmf)."""
    pmf = routed_pmf(bs)
    return sum(-(-n // rows) * pmf[n] for n in range(1, bs + 1)) / (1 - pmf[0])


@functools.cache
def _loop(mod: str, name: str) -> tuple[int, int]:
    """(K-loop instructions, cycles) a warp of AOT config ``name`` compiled for sm70 (inner_loop_mix)."""
    mix = inner_loop_mix(compile_config(mod, name, 70).asm["cubin"])
    return sum(mix.values()), loop_cycles(mix)


def loop_seconds(mod: str, name: str, weights: float, tile: tuple[int, int, int], passes: float) -> dict:
    """Compute seconds on a V100 of ``weights`` int4 weights through config ``name``'s K loop (tile = (BLOCK_K8,
    BLOCK_N, warps)), ``passes`` times: the tiles' warps x cycles over 80 SMs x 4 schedulers at 1.53 GHz."""
    bk8, bn, warps = tile
    instructions, cycles = _loop(mod, name)
    s = weights / (bk8 * 8 * bn) * warps * passes * cycles / (V100_SMS * V100_SCHEDULERS * V100_CLOCK)
    return {"config": name, "loop_instructions": instructions, "cycles": cycles, "passes": passes, "us": s * 1e6}


def moe_decode_sass(bs: int, distinct: float) -> dict:
    """The decode MoE of a ``bs``-token step (1 < bs <= 16) on sm70 from its SASS: per stage the config it takes
    (the row step or the 16-row dot), the K loop's instructions and cycles a warp, the passes; -> those and the
    compute microseconds of one launch pair."""
    from onecard.kernels.fused_moe.stages import DECODE_CONFIGS

    rows = paths.decode_rows(bs, 70)
    _, bn, bk8, warps, _, _ = DECODE_CONFIGS["decode16-pre-sm80"]
    passes = expected_passes(bs, rows) if rows else 1.0
    kind = "rows" if rows else "float=False,per_row=False"
    stages = [loop_seconds("fused_moe", f"moe_decode[decode16-pre-sm80,stage={stage},{kind},fp16]",
                           distinct * weights, (bk8, bn, warps), passes) for stage, weights in ((1, 2 * H * I),
                                                                                                 (2, I * H))]
    return {"rows": rows, "passes": passes, "stages": {st["config"]: st for st in stages},
            "us": sum(st["us"] for st in stages)}


def dense_sass_s(bs: int, k: int, n: int) -> float:
    """Compute seconds on a V100 of a ``bs``-row skinny GEMM (1 < bs <= 16) of K x N int4 weights from its SASS:
    the row step's ceil(bs / 2) passes (paths.dense_rows) or the 16-row dot's one."""
    from onecard.kernels.gptq_gemm.triton import _CONFIGS

    _, bn, bk8, _, warps, _ = _CONFIGS["skinny"]
    rows = paths.dense_rows(bs, 70)
    name = "w4a16[skinny,rows,fp16]" if rows else "w4a16[skinny,fp16]"
    return loop_seconds("gptq_gemm", name, k * n, (bk8, bn, warps), -(-bs // rows) if rows else 1)["us"] * 1e-6


def decode(bs: int, h200: dict[str, float], ctx: int = CTX) -> list[Kernel]:
    """One decode step of ``bs`` sequences at ``ctx`` tokens of context, on the sm70 paths (Triton everywhere but
    lm_head; decode configs decode1 / decode16-pre-sm80, split-KV attention as split_launch has it)."""
    cc = 70
    assert paths.choose("dense_gemm", bs, cc) in ("gemv", "skinny") and paths.choose("moe", bs, cc).startswith("decode")
    qkv_n = (NQ + 2 * NKV) * D
    distinct = expected_distinct_experts(bs, E, TOPK)
    act = bs * H * 2
    kv = bs * ctx * 2 * NKV * D * 2
    split = split_launch(bs, ctx, V100_SMS, cc)
    fold = paths.batch1_router_fold(bs) and paths.batch1_moe_slices()
    ks = [
        Kernel("rms_norm (input; bs16 also post-attention)", L * (1 if bs == 1 else 2), 3 * act + H * 2, 0, "fma",
               h200_us=h200.get("rms")),
        Kernel("qkv GEMV / skinny (+ memset, reduce at bs16)", L, gptq_bytes(H, qkv_n) + act, gemm(bs, H, qkv_n),
               "fma", dequant=H * qkv_n, h200_us=h200.get("qkv"),
               v100_compute_s=dense_sass_s(bs, H, qkv_n) if bs > 1 else None),
        Kernel("q/k-norm + RoPE + KV store", L, bs * qkv_n * 2 * 2, 0, "fma", h200_us=h200.get("rope")),
        Kernel(f"paged attention, {ctx:,}-token contexts (split-KV: {split['segments']} segments, "
               f"{split['working']} of {split['programs']} programs with keys)", L, kv + bs * NQ * D * 4,
               4.0 * bs * ctx * D * NQ, "fma", h200_us=h200.get("attn")),
        Kernel(f"segment reduce ({split['filled']} filled segments)", L, split["reduce_mb"] * 1e6, 0, "fma",
               h200_us=h200.get("reduce")),
        # batch 1 with the router folded into o_proj (fused_moe/router_fold.py; no cc condition): o_proj also reads
        # F [E, H] and M [E, K_o] and there is no router launch; the slices normalise and route themselves
        Kernel("o_proj GEMV / skinny" + (" + the folded router (M @ a + F @ r)" if fold else ""), L,
               gptq_bytes(NQ * D, H) + act + (E * (NQ * D + H) * 2 if fold else 0),
               gemm(bs, NQ * D, H) + (gemm(1, NQ * D + H, E) if fold else 0), "fma",
               dequant=NQ * D * H, h200_us=h200.get("o"),
               v100_compute_s=dense_sass_s(bs, NQ * D, H) if bs > 1 else None),
        *([] if fold else [Kernel("router GEMV + routing (bs1: with the norm, one launch)", L, E * H * 2 + act,
                                  gemm(bs, H, E), "fma", h200_us=h200.get("route"))]),
        # batch 1: both stages in one launch of intermediate slices (fused_moe/slices.py, no cc condition: sm70
        # runs it too); the bytes are the stages' (+ the down's scales once per slice: ~5%, not counted here)
        Kernel(f"decode MoE, {'one launch of slices' if bs == 1 and paths.batch1_moe_slices() else '2 stages'}"
               f"{' (normalising and routing themselves)' if fold else ''} "
               f"({distinct:.0f} distinct experts)", L,
               distinct * (2 * gptq_bytes(H, I) + gptq_bytes(I, H)), bs * TOPK * (gemm(1, H, 2 * I) + gemm(1, I, H)),
               "fma", dequant=distinct * 3 * H * I, h200_us=h200.get("moe"),
               v100_compute_s=moe_decode_sass(bs, distinct)["us"] * 1e-6 if bs > 1 else None),
        Kernel("lm_head (fp16, cuBLAS)", 1, V * H * 2 + act, gemm(bs, H, V), "tc", h200_us=h200.get("lm_head")),
    ]
    if bs > 1:
        ks.insert(-1, Kernel("MoE finish", L, bs * H * 6, 0, "fma", h200_us=h200.get("finish")))
    return ks


def prefill(h200: dict[str, float]) -> list[Kernel]:
    """One 4,096-token prefill on the sm70 paths: dense GEMMs dequantize + cuBLAS (>= 65 rows), the MoE
    dequantizes all experts and runs one cuBLAS GEMM per expert (>= 256 tokens), attention is SDPA's
    memory-efficient kernel (paths.prefill_sdpa; tensor cores)."""
    t, cc = PREFILL, 70
    assert paths.choose("dense_gemm", t, cc) == "cublas" and paths.choose("moe", t, cc) == "per-expert"
    assert paths.prefill_sdpa(t, cc)
    qkv_n = (NQ + 2 * NKV) * D
    act = t * H * 2
    p = t * TOPK
    # causal: each program's block of 64 query rows of one head reads the keys up to its last row (no L2 reuse
    # counted; the Triton kernel's 8 tokens x 8 heads of one KV head read as many)
    kv_reads = (t / 64) * NQ * (t / 2) * D * 2 * 2
    experts_w = 3 * E * H * I
    return [
        Kernel("rms_norm x 2", 2 * L, 3 * act, 0, "fma"),
        Kernel("dequantize qkv + o_proj weights (Triton)", L, gptq_bytes(H, qkv_n) + gptq_bytes(NQ * D, H)
               + (H * qkv_n + NQ * D * H) * 2, 0, "fma", dequant=H * qkv_n + NQ * D * H),
        Kernel("qkv + o_proj GEMMs (cuBLAS fp16)", L, act * 3 + (H * qkv_n + NQ * D * H) * 2 + t * qkv_n * 2,
               gemm(t, H, qkv_n) + gemm(t, NQ * D, H), "tc"),
        Kernel("q/k-norm + RoPE + KV store", L, t * qkv_n * 2 * 2, 0, "fma"),
        Kernel("gather K and V for SDPA (the sequence's blocks)", L, 2 * 2 * t * NKV * D * 2, 0, "fma"),
        Kernel("attention, causal 4k (SDPA memory-efficient, tensor cores on sm70)", L,
               kv_reads + 2 * t * NQ * D * 2 * 2, 4.0 * NQ * D * t * t / 2, "sdpa"),
        Kernel("router (cuBLAS) + routing", L, act + E * H * 2 + t * E * 2, gemm(t, H, E), "tc"),
        Kernel("dequantize all experts, 3 projections (Triton)", L, 3 * E * gptq_bytes(H, I) + experts_w * 2, 0,
               "fma", dequant=experts_w, h200_us=h200.get("moe_dequant")),
        Kernel(f"expert GEMMs: one cuBLAS GEMM per expert x 3 ({3 * E} launches from Python)", L,
               experts_w * 2 + p * H * 2 * 3 + p * I * 2 * 3, p * (gemm(1, H, 2 * I) + gemm(1, I, H)), "tc",
               h200_us=h200.get("moe_gemm"), host_s=3 * E * HOST_MATMUL_S),
        Kernel("top-k gather + sum", L, p * H * 2 + t * H * 4, 0, "fma"),
    ]


# H200 measured, us per launch (BENCHMARKS.md). bs1: T1 profile (8 layers / 8); bs16 and prefill: run I.
H200_BS1 = {"rms": 14 / 8, "qkv": 5.8, "rope": 20 / 8, "attn": 33 / 8, "reduce": 15 / 8, "o": 5.8, "route": 42 / 8,
            "moe": 145 / 8, "lm_head": 144}
H200_BS16 = {"rms": 3.9 / 2, "qkv": 10.0, "rope": 2.8, "attn": 11.6, "reduce": 2.6, "o": 10.0, "route": 5.2 + 4.5,
             "moe": 80.7, "finish": 1.1, "lm_head": 147}
H200_PREFILL = {"moe_dequant": 3 * 152, "moe_gemm": 3 * 186}   # (its attention, 530: the Triton kernel, not SDPA)


def table(kernels: list[Kernel], tokens: int) -> dict:
    rows = [k.row() for k in kernels]
    tot = {c: sum(r[c] * r["count"] for r in rows) for c in ("v100_roofline_us", "v100_bound_us", "v100_h200eff_us")}
    top = max(rows, key=lambda r: r["v100_bound_us"] * r["count"])
    return {"rows": rows, "step_us": tot, "tok_s": {c: tokens / (v * 1e-6) for c, v in tot.items()},
            "dominant": top["kernel"], "dominant_share": top["v100_bound_us"] * top["count"] / tot["v100_bound_us"]}


def markdown(title: str, t: dict) -> str:
    head = ("| kernel | launches | MB / launch | GFLOP / launch | limit | V100 roofline µs | H200 measured µs | "
            "V100 bound µs | V100 at H200's efficiency µs |")
    out = [f"**{title}**", "", head, "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in t["rows"]:
        h = "—" if r["h200_us"] is None else f"{r['h200_us']:.1f}"
        out.append(f"| {r['kernel']} | {r['count']} | {r['mb']:.2f} | {r['gflop']:.3f} | {r['limit']} | "
                   f"{r['v100_roofline_us']:.1f} | {h} | {r['v100_bound_us']:.1f} | {r['v100_h200eff_us']:.1f} |")
    s, k = t["step_us"], t["tok_s"]
    out.append(f"| **step** | | | | | **{s['v100_roofline_us'] / 1e3:.2f} ms** | | **{s['v100_bound_us'] / 1e3:.2f} ms** | "
               f"**{s['v100_h200eff_us'] / 1e3:.2f} ms** |")
    out.append(f"| **tok/s** | | | | | **{k['v100_roofline_us']:,.0f}** | | **{k['v100_bound_us']:,.0f}** | "
               f"**{k['v100_h200eff_us']:,.0f}** |")
    out.append("")
    out.append(f"Dominant (bound column): {t['dominant']}, {100 * t['dominant_share']:.0f}% of the step.")
    return "\n".join(out)


SPLIT_CASES = ((1, 512), (1, 32768), (1, 65536), (16, 512), (16, 8192))
LONG = ((1, 32768), (1, 65536), (16, 8192))    # decode steps at the long contexts (fp16 KV)
CARDS = (("V100", V100_SMS, 70), ("H100/H200", 132, 90))


def split_markdown(cards=CARDS) -> str:
    head = ("| card | batch x context | segments (fill) | key tiles per segment | programs launched / with keys | "
            "resident wave | waves | KV MB per launch | reduce MB | V100 µs at 750 GB/s |")
    out = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for card, sms, cc in cards:
        for bs, ctx in SPLIT_CASES:
            r = split_launch(bs, ctx, sms, cc)
            us = (r["kv_mb"] + r["reduce_mb"]) * 1e6 / V100["bw"] * 1e6 if card == "V100" else None
            out.append(f"| {card} | {bs} x {ctx:,} | {r['segments']} | {r['tiles_per_segment']} x {r['block_n']} keys | "
                       f"{r['programs']} / {r['working']} | {r['wave']} | {r['waves']} | {r['kv_mb']:.1f} | "
                       f"{r['reduce_mb']:.2f} | {'—' if us is None else f'{us:.1f}'} |")
    return "\n".join(out)


def long_markdown(res: dict) -> str:
    head = ("| batch x context (fp16 KV) | attention + reduce µs per layer | step ms (bound) | tok/s (bound) | "
            "tok/s at pure bandwidth | attention's share |")
    out = [head, "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, t in res.items():
        att = sum(r["v100_bound_us"] for r in t["rows"] if r["kernel"].startswith(("paged attention", "segment")))
        share = att * L / t["step_us"]["v100_bound_us"]
        out.append(f"| {key} | {att:.0f} | {t['step_us']['v100_bound_us'] / 1e3:.2f} | "
                   f"{t['tok_s']['v100_bound_us']:,.0f} | {t['tok_s']['v100_roofline_us']:,.0f} | {share:.0%} |")
    return "\n".join(out)


def sass_markdown(bs: int = 16) -> tuple[str, dict]:
    """The batch-``bs`` decode MoE's compute on a V100 from its SASS, the row step (shipped) against the 16-row dot
    (switch "pre_ampere_decode_rows" off): -> (a markdown table, the figures)."""
    distinct = expected_distinct_experts(bs, E, TOPK)
    res = {"rows": moe_decode_sass(bs, distinct)}
    paths.set_switch("pre_ampere_decode_rows", False)
    try:
        res["dot"] = moe_decode_sass(bs, distinct)
    finally:
        paths.set_switch("pre_ampere_decode_rows", None)
    out = [("| path | config (sm70 SASS) | K-loop instructions a warp | cycles a warp (pipe model) | passes | "
            "compute µs a layer |"), "| --- | --- | ---: | ---: | ---: | ---: |"]
    for path, r in res.items():
        for name, st in r["stages"].items():
            out.append(f"| {path} | {name} | {st['loop_instructions']:,} | {st['cycles']:,} | {r['passes']:.2f} | "
                       f"{st['us']:.0f} |")
        out.append(f"| {path} | **both stages** | | | | **{r['us']:.0f}** |")
    return "\n".join(out), res


PREFILL_MOE_TOKENS = (64, 128, 192, 256, 320, 384, 448, 512, 768, 1024)
HOST_LOW_S = 5e-6                                     # the per-expert loop's launch at half HOST_MATMUL_S


def prefill_moe_markdown() -> tuple[str, dict]:
    """The prefill MoE of one layer below sm80 at PREFILL_MOE_TOKENS tokens, on its two paths: sorted16 (the
    Triton kernel's FMA dot, 16-row blocks of each expert's pairs: its sm70 SASS through the pipe model, per block)
    against the per-expert path (all experts dequantized: bytes; one cuBLAS GEMM per active expert and projection:
    tensor-core FLOPs or host launches at HOST_MATMUL_S / HOST_LOW_S, whichever is longer). The parts both share
    (routing, the top-k sum) are left out. -> (a markdown table, the figures)."""
    from onecard.kernels.fused_moe.triton import _CONFIGS

    bm, bn1, bn2, bk8, warps, _ = _CONFIGS["sorted16"]
    gate = loop_seconds("fused_moe", "moe[sorted16,gated=True,float=False,fp16]", H * I, (bk8, bn1, warps), 1)
    down = loop_seconds("fused_moe", "moe[sorted16,gated=False,float=False,fp16]", I * H, (bk8, bn2, warps), 1)
    per_block = gate["us"] + down["us"]
    dequant = (3 * E * gptq_bytes(H, I) + 3 * E * H * I * 2) / V100["bw"] * 1e6
    head = ("| tokens | shipped (paths.choose_moe, sm70) | sorted16 blocks | sorted16 µs | per-expert µs, "
            f"host {HOST_MATMUL_S * 1e6:.0f} µs a GEMM | per-expert µs, host {HOST_LOW_S * 1e6:.0f} µs |")
    res, out = {}, [head, "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for t in PREFILL_MOE_TOKENS:
        active = E * (1 - routed_pmf(t)[0])                             # experts with tokens
        blocks = active * expected_passes(t, bm)                        # their 16-row blocks
        tc = t * TOPK * (gemm(1, H, 2 * I) + gemm(1, I, H)) / V100["tc"] * 1e6
        r = {"path": paths.choose_moe(t, 70, grouped_dtypes=()), "blocks": blocks, "sorted16_us": blocks * per_block,
             "per_expert_us": dequant + max(tc, 3 * active * HOST_MATMUL_S * 1e6),
             "per_expert_low_host_us": dequant + max(tc, 3 * active * HOST_LOW_S * 1e6)}
        res[t] = r
        out.append(f"| {t:,} | {r['path']} | {blocks:.0f} | {r['sorted16_us']:,.0f} | {r['per_expert_us']:,.0f} | "
                   f"{r['per_expert_low_host_us']:,.0f} |")
    res["per_block_us"], res["dequant_us"] = per_block, dequant
    res["sass"] = {st["config"]: {"loop_instructions": st["loop_instructions"], "cycles": st["cycles"]}
                   for st in (gate, down)}
    return "\n".join(out), res


BATCHES = (1, 2, 4, 8, 16)


def batches_markdown() -> tuple[str, dict]:
    """Decode steps at 512-token contexts for BATCHES sequences by the V100 roofline (bytes, or compute from the
    SASS where modelled; no latency floor: the H200 has none measured between batch 1 and 16), with the row steps
    (shipped) and with the 16-row dots (switch "pre_ampere_decode_rows" off): -> (a markdown table, the
    figures)."""
    res: dict = {}
    for on in (True, False):
        paths.set_switch("pre_ampere_decode_rows", on)
        try:
            res["rows" if on else "dot"] = {bs: table(decode(bs, {}), bs) for bs in BATCHES}
        finally:
            paths.set_switch("pre_ampere_decode_rows", None)
    out = ["| batch | step ms, row steps | tok/s, row steps | step ms, 16-row dots | tok/s, 16-row dots |",
           "| ---: | ---: | ---: | ---: | ---: |"]
    for bs in BATCHES:
        a, b = res["rows"][bs], res["dot"][bs]
        out.append(f"| {bs} | {a['step_us']['v100_roofline_us'] / 1e3:.2f} | {a['tok_s']['v100_roofline_us']:,.0f} | "
                   f"{b['step_us']['v100_roofline_us'] / 1e3:.2f} | {b['tok_s']['v100_roofline_us']:,.0f} |")
    return "\n".join(out), {k: {bs: t["tok_s"]["v100_roofline_us"] for bs, t in v.items()} for k, v in res.items()}


def main(out: str | None = None) -> dict:
    no_attn = {"attn", "reduce"}                      # measured at 512-token contexts only
    long = {f"{bs} x {ctx:,}": table(decode(bs, {k: v for k, v in (H200_BS1 if bs == 1 else H200_BS16).items()
                                                 if k not in no_attn}, ctx), bs) for bs, ctx in LONG}
    res = {"bs1": table(decode(1, H200_BS1), 1), "bs16": table(decode(16, H200_BS16), 16),
           "prefill4096": table(prefill(H200_PREFILL), PREFILL), "long_context": long,
           "split_kv": [split_launch(bs, ctx, sms, cc) for _, sms, cc in CARDS for bs, ctx in SPLIT_CASES],
           "assumptions": {"v100": V100, "h200": H200, "dequant_ops": DEQUANT_OPS, "host_matmul_s": HOST_MATMUL_S,
                           "context": CTX, "group_size": G, "graph_bound": GRAPH_BOUND}}
    print(markdown("Decode, batch 1, 512-token context (per launch; 48 layers)", res["bs1"]), "\n")
    print(markdown("Decode, batch 16, 512-token contexts", res["bs16"]), "\n")
    table_, res["moe_decode_sass_bs16"] = sass_markdown(16)
    print("**The batch-16 decode MoE's compute on a V100, from its sm70 SASS (82 distinct experts, 202 MB: "
          f"{202.06e6 / V100['bw'] * 1e6:.0f} µs of bytes)**\n")
    print(table_, "\n")
    table_, res["batches_tok_s"] = batches_markdown()
    print("**Decode at 1-16 sequences of 512 tokens on a V100 (roofline column: no latency floor): the row steps "
          "below sm80 (the MoE's and the skinny GEMM's, paths.decode_rows / dense_rows) against the 16-row FMA "
          "dots**\n")
    print(table_, "\n")
    print(markdown("Prefill, one 4,096-token prompt", res["prefill4096"]), "\n")
    table_, res["prefill_moe_paths"] = prefill_moe_markdown()
    print("**The prefill MoE below sm80, one layer: sorted16 (FMA dot, its sm70 SASS) against the per-expert path "
          f"(dequantize all experts: {res['prefill_moe_paths']['dequant_us']:,.0f} µs of bytes; then cuBLAS, bound "
          "by tensor-core FLOPs or by the host's launches)**\n")
    print(table_, "\n")
    print("**Split-KV launches of the decode graph (policy fill, bound 65,536; derived from kernels/paths.py)**\n")
    print(split_markdown(), "\n")
    print("**Decode at long contexts on a V100 (derived; the attention rows at 750 GB/s, no measured time)**\n")
    print(long_markdown(long))
    if out:
        Path(out).write_text(json.dumps(res, indent=1, default=lambda o: asdict(o)))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
