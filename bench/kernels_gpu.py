"""Every Triton kernel vs its ref at the real Qwen3-30B-A3B shapes on a CUDA GPU: correctness (relative
error) and timing: triton.testing.do_bench median ("triton us", includes Python launch overhead) and CUDA-graph
replay ("graph us": the op captured in a torch.cuda.CUDAGraph, 20 copies per graph, timed with events over
replays; what the served model sees), with achieved GB/s from the graph time. Prints a table; writes JSON to
$OUT/kernels_gpu.json when OUT is set.  Usage: python bench/kernels_gpu.py [--quick] [--only SUB1,SUB2]
(--only: the ops whose name contains one of the comma-separated substrings)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from functools import partial

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kernels_testlib import make_paged_batch, route_gap

from onecard.kernels.types import GPTQWeight

H, HQ, HKV, D, E, TOPK, I, G = 2048, 32, 4, 128, 128, 8, 768, 128
DEV = torch.device("cuda")


def rand_gptq(k: int, n: int, experts: int | None = None) -> GPTQWeight:
    lead = () if experts is None else (experts,)
    return GPTQWeight(
        qweight=torch.randint(-2**31, 2**31 - 1, lead + (k // 8, n), dtype=torch.int32, device=DEV),
        qzeros=torch.randint(-2**31, 2**31 - 1, lead + (k // G, n // 8), dtype=torch.int32, device=DEV),
        scales=(torch.rand(lead + (k // G, n), device=DEV) * 0.01 + 0.001).half(),
        g_idx=None, group_size=G, in_features=k, out_features=n)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))   # ms


def bench_graph(fn, copies: int = 20, replays: int = 20) -> float:
    """Microseconds per call of ``fn`` under CUDA-graph replay (nan when it cannot be captured)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()                                   # warm up (JIT, caches) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(copies):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (replays * copies)
    except Exception as e:                             # report, keep benchmarking the rest
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]})")
        return float("nan")


class _Rotating:
    """Inputs that change at every call of a row's Triton function: ``bench_graph`` captures its copies with
    the next one each, so a MoE row's routed experts differ from copy to copy and come from HBM, as a layer's do
    in the model (with one input the 20 copies re-read the same ~19 MB, which then sit in the 50 MB L2: the rows
    without it are L2-hot). ``last``: what the previous call used (the reference, called after it, reads it)."""

    def __init__(self, items: list):
        self.items, self.i = items, -1

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]

    @property
    def last(self):
        return self.items[self.i]


def _switched(name: str, fn, on: bool | None = True):
    """fn() with paths switch ``name`` on (or ``on=False``: off; None: as shipped), back to its shipped value after."""
    from onecard.kernels import paths

    paths.set_switch(name, on)
    try:
        return fn()
    finally:
        paths.set_switch(name, None)


def _stages(fn):
    """fn() with the batch-1 MoE's two-launch expert stages (the slices switched off)."""
    return _switched("batch1_moe_slices", fn, on=False)


def _slices(cfg, fn):
    """fn() with the batch-1 MoE's one-launch stages on, at slices config cfg (None: the shipped one)."""
    from onecard.kernels.fused_moe import slices

    shipped = slices.SLICES_CONFIG
    slices.SLICES_CONFIG = cfg or shipped
    try:
        return _switched("batch1_moe_slices", fn)
    finally:
        slices.SLICES_CONFIG = shipped


def cases(quick: bool):
    from onecard.kernels.triton_common import set_pdl

    set_pdl(int(os.environ.get("ONECARD_PDL_MAX_TOKENS", "1")))          # as the runner does from Env
    from onecard.kernels.activation import ref as act_r
    from onecard.kernels.activation import triton as act_t
    from onecard.kernels.attention import ref as at_r
    from onecard.kernels.attention import triton as at_t
    from onecard.kernels.fused_moe import ref as moe_r
    from onecard.kernels.fused_moe import router_fold
    from onecard.kernels.fused_moe import slices as slices_mod
    from onecard.kernels.fused_moe import triton as moe_t
    from onecard.kernels.gptq_gemm import ref as g_r
    from onecard.kernels.gptq_gemm import triton as g_t
    from onecard.kernels.norm import ref as n_r
    from onecard.kernels.norm import triton as n_t
    from onecard.kernels.rope import ref as r_r
    from onecard.kernels.rope import triton as r_t

    for name, k, n in (("qkv_proj", H, (HQ + 2 * HKV) * D), ("o_proj", HQ * D, H)):
        w = rand_gptq(k, n)
        for m in (1, 16, 512, 4096):
            x = torch.randn(m, k, device=DEV, dtype=torch.float16) / math.sqrt(k)
            nbytes = w.nbytes() + x.numel() * 2 + m * n * 2
            yield (f"w4a16 {name} M={m}", lambda x=x, w=w: g_t.w4a16_gemm(x, w),
                   lambda x=x, w=w: g_r.w4a16_gemm(x, w), nbytes)
            if m == 1:         # accumulating into a zeroed fp32 row (paths.batch1_accumulate; the memset here
                acc = torch.zeros(1, n, device=DEV)                # is the input norm's job in the model)
                yield (f"w4a16 {name} M=1 accumulate (+memset)",
                       lambda x=x, w=w, acc=acc: g_t.small_m_gemm(x, w, accumulate=acc.zero_()),
                       lambda x=x, w=w: g_r.w4a16_gemm(x, w), nbytes)
            if m == 16:        # the exact-integer dot ("decode_int_dot", shipped on: here forced)
                yield (f"w4a16 {name} M={m} int dot",
                       lambda x=x, w=w: _switched("decode_int_dot", lambda: g_t.w4a16_gemm(x, w)),
                       lambda x=x, w=w: g_r.w4a16_gemm(x, w), nbytes)
    yield from _attn_block_cases()
    wr = (torch.randn(E, H, device=DEV) / math.sqrt(H)).half()
    for t in (1, 16):
        x = torch.randn(t, H, device=DEV, dtype=torch.float16)
        yield (f"moe_router T={t}", lambda x=x: moe_t.moe_router(x, wr),
               lambda x=x: moe_r.moe_router(x.float(), wr.float()), E * H * 2)
        # the cuBLAS call it replaces at decode (same fp32 reference): timing comparison
        yield (f"moe_router cuBLAS T={t}", lambda x=x: torch.nn.functional.linear(x, wr),
               lambda x=x: moe_r.moe_router(x.float(), wr.float()), E * H * 2)
    wg, wu, wd = rand_gptq(H, I, E), rand_gptq(H, I, E), rand_gptq(I, H, E)
    per_expert = (wg.nbytes() + wu.nbytes() + wd.nbytes()) / E
    for t in (1, 16, 512) if quick else (1, 4, 16, 64, 512, 4096):
        x = torch.randn(t, H, device=DEV, dtype=torch.float16)
        logits = torch.randn(t, E, device=DEV, dtype=torch.float16)
        distinct = int(torch.unique(moe_r.route(logits, TOPK, True)[1]).numel())
        yield (f"fused_moe T={t}", lambda x=x, logits=logits: moe_t.fused_moe(x, logits, wg, wu, wd, TOPK, True),
               lambda x=x, logits=logits: moe_r.fused_moe(x, logits, wg, wu, wd, TOPK, True), distinct * per_expert)
        # the decode MoE's switches (kernels/paths.py), each on alone, against the same reference
        switches = {16: (("silu launch", "decode_moe_act_launch"), ("int dot", "decode_int_dot"))}
        if t in switches:
            for label, sw in switches[t]:
                yield (f"fused_moe T={t} {label}",
                       lambda x=x, logits=logits, sw=sw: _switched(
                           sw, lambda: moe_t.fused_moe(x, logits, wg, wu, wd, TOPK, True)),
                       lambda x=x, logits=logits: moe_r.fused_moe(x, logits, wg, wu, wd, TOPK, True),
                       distinct * per_expert)
    # the layer's whole MoE block: post-attention RMSNorm + router + experts (batch 1: fused_moe/batch1.py),
    # and at T = 1 the unfused chain it replaced (rms_norm, router, fused_moe) for timing
    nw = (1 + 0.1 * torch.randn(H, device=DEV)).half()
    for t in (1, 16):
        x, r = torch.randn(t, H, device=DEV).half(), torch.randn(t, H, device=DEV).half()
        yield (f"norm_moe T={t}",                     # T=1: the shipped path (the slices, routing themselves)
               lambda x=x, r=r: torch.cat(moe_t.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
               lambda x=x, r=r: torch.cat(moe_r.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
               TOPK * per_expert + E * H * 2)
        if t == 1:
            # the two-launch expert stages (paths switch "batch1_moe_slices" off)
            yield ("norm_moe T=1 two-launch stages",
                   lambda x=x, r=r: _stages(lambda: torch.cat(
                       moe_t.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True))),
                   lambda x=x, r=r: torch.cat(moe_r.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                   TOPK * per_expert + E * H * 2)
        if t == 1:
            # the expert stages in one launch (paths switch "batch1_moe_slices"; fused_moe/slices.py), routing
            # themselves as shipped: the shipped SLICES_CONFIG (the gate/up loop pipelined 3 deep), then other
            # (BLOCK_I, BLOCK_K8, BLOCK_H, warps, stages) to tune it (sm90 registers: shipped 98; the one-ahead loop
            # 124; 127; 115; 127; 127; 127; 117; 98. Programs: 192; 192; 192; 192; 192; 384; 96; 384; 192)
            for cfg in (None, (32, 32, 1024, 8, 1), (32, 32, 2048, 8, 1), (32, 32, 512, 8, 1), (32, 16, 1024, 4, 1),
                        (16, 32, 1024, 4, 1), (64, 16, 512, 8, 1), (16, 64, 1024, 8, 1), (32, 32, 1024, 8, 8)):
                yield (f"norm_moe T=1 slices{'' if cfg is None else ' ' + ','.join(map(str, cfg))}",
                       lambda x=x, r=r, cfg=cfg: _slices(cfg, lambda: torch.cat(
                           moe_t.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True))),
                       lambda x=x, r=r: torch.cat(moe_r.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                       TOPK * per_expert + E * H * 2)
            # the MoE block with cold experts (_Rotating: 20 inputs routed to different experts): the slices at the
            # shipped config, the one-ahead loop and five others, the shipped config with fp32 dots (the switch
            # "batch1_slices_half2" off), the two-launch stages
            xs = _Rotating([torch.randn(1, H, device=DEV).half() for _ in range(20)])
            cold = [(f"slices{'' if cfg is None else ' ' + ','.join(map(str, cfg))}", partial(_slices, cfg))
                    for cfg in (None, (32, 32, 1024, 8, 1), (32, 16, 1024, 4, 1), (32, 32, 1024, 8, 8),
                                (16, 32, 512, 8, 3), (16, 32, 512, 4, 3), (16, 64, 512, 4, 3))]
            cold += [("slices, fp32 dots", lambda fn: _switched("batch1_slices_half2", lambda: _slices(None, fn), on=False)),
                     ("two-launch stages", _stages)]
            for label, path in cold:
                yield (f"norm_moe T=1 {label}, cold experts",
                       lambda r=r, path=path, xs=xs: path(lambda: torch.cat(
                           moe_t.norm_moe(xs.next(), r, nw, 1e-6, wr, wg, wu, wd, TOPK, True))),
                       lambda r=r, xs=xs: torch.cat(moe_r.norm_moe(xs.last, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                       TOPK * per_expert + E * H * 2)
            # no norm-route launch (paths.batch1_router_fold): the slices normalise x (fp32 sums, as the attention
            # block leaves them) and route from the folded router's sums, (gate * nw) @ (x + r) here
            x32 = _clear_routing(r, nw, wr)
            raw = (x32 + r.float()) @ (wr.float() * nw.float()[None, :]).t()
            yield ("norm_moe T=1 slices, router folded",
                   lambda x32=x32, r=r, raw=raw: torch.cat(moe_t.norm_moe(
                       x32, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True,
                       folded=router_fold.FoldedRoute(raw, torch.zeros(1, H, device=DEV)))),
                   lambda x32=x32, r=r: torch.cat(moe_r.norm_moe(x32, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                   TOPK * per_expert)
            # on the pre-Ampere loop, and with the dots in fp32 (paths.batch1_slices_half2 off) on both loops
            for label, cfg, h2 in ((" one-ahead", slices_mod.SLICES_CONFIG_PRE_AMPERE, None), (", fp32 dots", None, False),
                                   (", fp32 dots one-ahead", slices_mod.SLICES_CONFIG_PRE_AMPERE, False)):
                yield (f"norm_moe T=1 slices, router folded{label}",
                       lambda x32=x32, r=r, raw=raw, cfg=cfg, h2=h2: _switched("batch1_slices_half2", lambda: _slices(
                           cfg, lambda: torch.cat(moe_t.norm_moe(
                               x32, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True,
                               folded=router_fold.FoldedRoute(raw, torch.zeros(1, H, device=DEV))))), on=h2),
                       lambda x32=x32, r=r: torch.cat(moe_r.norm_moe(x32, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                       TOPK * per_expert)
            yield ("norm_moe T=1 slices, routed by norm-route",         # "batch1_slices_route" off
                   lambda x=x, r=r: _switched("batch1_slices_route", lambda: _slices(None, lambda: torch.cat(
                       moe_t.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True))), on=False),
                   lambda x=x, r=r: torch.cat(moe_r.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                   TOPK * per_expert + E * H * 2)
        if t == 1:
            def chain(x=x, r=r):
                h, res = n_t.rms_norm(x, nw, 1e-6, r)
                return torch.cat([moe_t.fused_moe(h, moe_t.moe_router(h, wr), wg, wu, wd, TOPK, True), res])
            yield ("norm+router+fused_moe T=1 (unfused)", chain,
                   lambda x=x, r=r: torch.cat(moe_r.norm_moe(x, r, nw, 1e-6, wr, wg, wu, wd, TOPK, True)),
                   TOPK * per_expert + E * H * 2)
    for b, ctx in ((1, 512), (1, 8192), (16, 512), (16, 8192)):
        kc, vc, md, _, _ = make_paged_batch([ctx] * b, [1] * b, HKV, D, 16, dtype=torch.float16)
        kc, vc = kc.to(DEV), vc.to(DEV)
        md = type(md)(md.slot_mapping.to(DEV), md.query_start_loc.to(DEV), md.seq_lens.to(DEV),
                      md.block_table.to(DEV), 1, ctx, b)
        q = torch.randn(b, HQ, D, device=DEV, dtype=torch.float16)
        s = 1 / math.sqrt(D)
        yield (f"paged_attn decode B={b} ctx={ctx}",
               lambda q=q, kc=kc, vc=vc, md=md, s=s: at_t.paged_attention(q, kc, vc, md, s),
               lambda q=q, kc=kc, vc=vc, md=md, s=s: at_r.paged_attention(q, kc, vc, md, s), b * ctx * HKV * D * 2 * 2)
    from onecard.kernels.attention import fp8
    fp8_formats = [("e5m2", fp8.E5M2, 1.0, 1.0)]
    if torch.cuda.get_device_capability() >= (8, 9):
        fp8_formats.append(("e4m3", fp8.E4M3, 0.5, 2.0))
    for name, cdt, ks, vs in fp8_formats:                 # fp8 KV: ref reads the dequantized cache (same values)
        for b, ctx in ((1, 8192), (16, 8192)):
            kc, vc, md, _, _ = make_paged_batch([ctx] * b, [1] * b, HKV, D, 16, dtype=torch.float16)
            k8, v8 = fp8.quantize(kc, cdt, ks).to(DEV), fp8.quantize(vc, cdt, vs).to(DEV)
            kd, vd = fp8.dequantize(k8, ks).half(), fp8.dequantize(v8, vs).half()
            md = type(md)(md.slot_mapping.to(DEV), md.query_start_loc.to(DEV), md.seq_lens.to(DEV),
                          md.block_table.to(DEV), 1, ctx, b)
            q = torch.randn(b, HQ, D, device=DEV, dtype=torch.float16)
            s = 1 / math.sqrt(D)
            yield (f"paged_attn decode B={b} ctx={ctx} kv={name}",
                   lambda q=q, k8=k8, v8=v8, md=md, ks=ks, vs=vs, s=s: at_t.paged_attention(q, k8, v8, md, s, ks, vs),
                   lambda q=q, kd=kd, vd=vd, md=md, s=s: at_r.paged_attention(q, kd, vd, md, s), b * ctx * HKV * D * 2)
    kc, vc, md, _, _ = make_paged_batch([2048, 1024], [512, 1024], HKV, D, 16, dtype=torch.float16)
    kc, vc = kc.to(DEV), vc.to(DEV)
    md = type(md)(md.slot_mapping.to(DEV), md.query_start_loc.to(DEV), md.seq_lens.to(DEV),
                  md.block_table.to(DEV), 1024, 2048, 0)
    q = torch.randn(1536, HQ, D, device=DEV, dtype=torch.float16)
    yield ("paged_attn prefill 512+1024",
           lambda q=q, kc=kc, vc=vc, md=md: at_t.paged_attention(q, kc, vc, md, 0.088),
           lambda q=q, kc=kc, vc=vc, md=md: at_r.paged_attention(q, kc, vc, md, 0.088),
           (3072 * HKV * D * 2 + 1536 * HQ * D * 2) * 2)
    for t in (1, 512):
        k, v = torch.randn(t, HKV, D, device=DEV).half(), torch.randn(t, HKV, D, device=DEV).half()
        kc = torch.zeros(256, 16, HKV, D, device=DEV).half()
        vc1, vc2, kc2 = kc.clone(), kc.clone(), kc.clone()
        slots = torch.randperm(4096, device=DEV)[:t]

        def tri(k=k, v=v, kc=kc, vc1=vc1, slots=slots):
            at_t.store_kv(k, v, kc, vc1, slots)
            return torch.cat([kc, vc1])

        def rf(k=k, v=v, kc2=kc2, vc2=vc2, slots=slots):
            at_r.store_kv(k, v, kc2, vc2, slots)
            return torch.cat([kc2, vc2])
        yield (f"store_kv T={t}", tri, rf, t * HKV * D * 2 * 4)
        x, r = torch.randn(t, H, device=DEV).half(), torch.randn(t, H, device=DEV).half()
        w = torch.randn(H, device=DEV).half()
        yield (f"rms_norm+res T={t}", lambda x=x, r=r, w=w: torch.cat(n_t.rms_norm(x, w, 1e-6, r)),
               lambda x=x, r=r, w=w: torch.cat(n_r.rms_norm(x, w, 1e-6, r)), t * H * 2 * 4)
        qq, kk = torch.randn(t, HQ, D, device=DEV).half(), torch.randn(t, HKV, D, device=DEV).half()
        pos = torch.randint(0, 4096, (t,), device=DEV)
        cache = rope_cache()
        yield (f"qk_norm_rope T={t}",
               lambda qq=qq, kk=kk, pos=pos, w=w, cache=cache: torch.cat([a.flatten() for a in r_t.qk_norm_rope(
                   qq, kk, w[:D], w[:D], pos, cache, 1e-6)]),
               lambda qq=qq, kk=kk, pos=pos, w=w, cache=cache: torch.cat([a.flatten() for a in r_r.qk_norm_rope(
                   qq, kk, w[:D], w[:D], pos, cache, 1e-6)]), t * (HQ + HKV) * D * 2 * 2)
        xa = torch.randn(t, 2 * I * TOPK, device=DEV).half()
        yield (f"silu_and_mul T={t}", lambda xa=xa: act_t.silu_and_mul(xa), lambda xa=xa: act_r.silu_and_mul(xa),
               t * I * TOPK * 2 * 3)


def rope_cache(positions: int = 4096) -> torch.Tensor:
    """fp32 [P, D] cos | sin at theta 1e7 (the model's)."""
    ang = torch.outer(torch.arange(positions, device=DEV).float(),
                      1.0 / (1e7 ** (torch.arange(0, D, 2, device=DEV).float() / D)))
    return torch.cat([ang.cos(), ang.sin()], -1)


def _clear_routing(r: torch.Tensor, nw: torch.Tensor, wr: torch.Tensor, margin: float = 1e-2) -> torch.Tensor:
    """x fp32 [1, H] (seeded draws) whose top-k routing after rms_norm(x + r) * nw is clear of ties (route_gap at
    least ``margin``). Where two paths round the logits
    differently (the router fold: fp32 sums times rstd, against the reference's fp16 matmul), a near-tie would
    route them to different experts and differ by a whole expert, not by rounding."""
    from onecard.kernels.norm import ref as norm_ref

    g = torch.Generator(device=DEV).manual_seed(11)
    for _ in range(64):
        x = torch.randn(1, H, device=DEV, generator=g)
        hn, _ = norm_ref.rms_norm(x, nw, 1e-6, r)                         # as the reference MoE block routes
        if route_gap(hn @ wr.t(), TOPK) >= margin:
            return x
    raise AssertionError("no draw routes clear of ties")


def _attn_block_cases():
    """A decoder layer's attention block at batch 1 (dispatch.attention_block: input RMSNorm of x fp32 +
    residual, qkv GEMV, q/k norm + RoPE + KV store, paged attention over 512 tokens split as in graphs bound at
    65,536, o_proj GEMV): the composed launches, with the accumulating GEMVs, and with the attention launch also
    doing q/k norm + RoPE + store (the defaults), and with the router folded into o_proj; each against
    attn_in/ref.attention_block. Compared: out | residual_out | the new K and V rows (and the folded sums)."""
    from onecard.kernels import dispatch, paths
    from onecard.kernels.attention.metadata import AttentionMetadata
    from onecard.kernels.attn_in import ref as ai_r
    from onecard.kernels.fused_moe import router_fold

    wq, wo = rand_gptq(H, (HQ + 2 * HKV) * D), rand_gptq(HQ * D, H)
    x, res = torch.randn(1, H, device=DEV), torch.randn(1, H, device=DEV).half()
    nw, qn, kn = ((1 + 0.1 * torch.randn(n, device=DEV)).half() for n in (H, D, D))
    ctx, bs = 512, 16
    blocks = torch.randperm(64, device=DEV).to(torch.int32)[None, :ctx // bs + 1]
    slot = int(blocks[0, ctx // bs]) * bs                                 # token ctx (0-based) in its block
    md = AttentionMetadata(slot_mapping=torch.tensor([slot], device=DEV), query_start_loc=torch.tensor(
        [0, 1], device=DEV, dtype=torch.int32), seq_lens=torch.tensor([ctx + 1], device=DEV, dtype=torch.int32),
        block_table=blocks, max_query_len=1, max_seq_len=65536, num_decode_tokens=1)
    pos, cache = torch.tensor([ctx], device=DEV), rope_cache()
    kc, vc = (torch.randn(64, bs, HKV, D, device=DEV).half() for _ in range(2))

    # the MoE router folded into o_proj (paths.batch1_router_fold): its sums against F @ (out + residual_out)
    gate, nw2 = (torch.randn(E, H, device=DEV) / H ** 0.5).half(), (1 + 0.1 * torch.randn(H, device=DEV)).half()
    fold = router_fold.build(gate, nw2, wo)
    f32 = gate.float() * nw2.float()[None, :]

    def run(fn, acc: bool = False, qk: bool = False, folded: bool = False):
        m = dataclasses.replace(md, max_seq_len=65536)                   # the served bound's split

        def call():
            paths.set_switch("batch1_accumulate", acc)
            paths.set_switch("batch1_attn_qk", qk)
            # with the fold, the dispatched op hands its sums over; the reference's are F @ (out + residual_out)
            kw = {"router_fold": fold} if folded and fn is not ai_r.attention_block else {}
            try:
                o, r, *handed = fn(x, res, nw, 1e-6, wq, None, qn, kn, pos, cache, kc, vc, m, D ** -0.5, wo, None,
                                   **kw)
            finally:
                paths.set_switch("batch1_accumulate", None)
                paths.set_switch("batch1_attn_qk", None)
            raw = []
            if folded:                                                    # [1, E]
                raw = [(handed[0].raw if handed else (o.float() + r.float()) @ f32.t()).flatten()]
            return torch.cat([o.float().flatten(), r.float().flatten(), kc.view(-1, HKV * D)[slot].float(),
                              vc.view(-1, HKV * D)[slot].float(), *raw])
        return call
    nbytes = wq.nbytes() + wo.nbytes() + (ctx + 1) * HKV * D * 2 * 2
    ref = run(ai_r.attention_block)
    yield "attention block T=1 (composed)", run(dispatch.attention_block), ref, nbytes
    yield "attention block T=1 accumulate", run(dispatch.attention_block, acc=True), ref, nbytes
    yield "attention block T=1 accumulate + attn qk", run(dispatch.attention_block, acc=True, qk=True), ref, nbytes
    yield ("attention block T=1 accumulate + attn qk + router fold",
           run(dispatch.attention_block, acc=True, qk=True, folded=True), run(ai_r.attention_block, folded=True),
           nbytes + fold.f.nbytes + fold.m.nbytes)


def main() -> None:
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else [""]
    rows = []
    print(f"{'op':40s} {'rel_err':>9s} {'triton us':>10s} {'graph us':>9s} {'ref us':>10s} {'GB/s':>8s}")
    for name, tri, rf, nbytes in cases(quick):
        if not any(sub in name for sub in only):
            continue
        err = rel(tri(), rf())
        t_ms, r_ms = bench(tri), bench(rf)
        g_us = bench_graph(tri)
        best_us = g_us if not math.isnan(g_us) else t_ms * 1e3                    # graph time unless capture failed
        gbs = nbytes / (best_us * 1e-6) / 1e9
        rows.append(dict(op=name, rel_err=err, triton_us=t_ms * 1e3, graph_us=g_us, ref_us=r_ms * 1e3,
                         gb_per_s=gbs, bytes=nbytes, ok=err < 1e-2))
        print(f"{name:40s} {err:9.2e} {t_ms * 1e3:10.1f} {g_us:9.1f} {r_ms * 1e3:10.1f} {gbs:8.0f}"
              + ("" if err < 1e-2 else "  FAIL"))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kernels_gpu.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
