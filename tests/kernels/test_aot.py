"""Ahead-of-time compile every Triton kernel at every block config its dispatcher can choose, for sm70,
sm75, sm80 and sm90, with no GPU (Triton's bundled ptxas). Catches pre-Ampere layout errors at CI time.

Configs come from each backend's ``aot_configs()``. fp16 variants compile for every target; bf16 variants
(sm80+ only) compile for sm90 alone: they take the same code path as sm80 and differ only in dtype.
For sm70 (the deployment's V100) every fp16 config compiles as the JIT specializes it at serving time:
16-byte-aligned pointers and 16-divisible integers (``tt.divisibility``, except ``do_not_specialize``
arguments), which turns on 16-byte vector loads and so other layouts than the plain compile; the real
shapes are multiples of 16 almost everywhere. The plain (unaligned) compile runs for sm75, 80 and 90, and for
sm70 only where test_jit_aligned_variants_are_the_vectorized_code compares the two (PLAIN_SM70): sm70's
unaligned layouts are sm75's pre-Ampere ones, and the ~110 duplicate compiles cost a cold CI ~2 minutes.
Jobs run in 2 worker processes; Triton's on-disk cache makes repeated runs cheap.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor

import pytest

triton = pytest.importorskip("triton")

MODULES = ["gptq_gemm", "fused_moe", "attention", "norm", "rope", "activation"]
TARGETS = [70, 75, 80, 90]


JIT_ALIGNED_TARGETS = (70,)
PLAIN_SM70 = ("w4a16[gemv,fp16]", "moe_decode[decode1,stage=1,float=False,per_row=False,fp16]")


def _jobs() -> list[tuple[str, int, int, bool]]:
    """(module, config index, cc, compile as the JIT specializes aligned arguments)."""
    jobs = []
    for mod in MODULES:
        configs = importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()
        for i, c in enumerate(configs):
            is_bf16 = any(v == "*bf16" for v in c.signature.values())
            for cc in TARGETS:
                if cc >= c.min_cc and (not is_bf16 or cc == 90):
                    if cc not in JIT_ALIGNED_TARGETS or c.name in PLAIN_SM70:
                        jobs.append((mod, i, cc, False))
                    if cc in JIT_ALIGNED_TARGETS:
                        jobs.append((mod, i, cc, True))
    return jobs


def jit_aligned_attrs(c) -> dict:
    """The attributes the JIT gives a launch whose pointers are 16-byte aligned and whose integers are
    multiples of 16 (``tt.divisibility``), for every argument it may specialize."""
    params = {p.name: p for p in c.kernel.params}
    attrs = {}
    for i, (name, ty) in enumerate(c.signature.items()):
        if name in c.constexprs or ty == "constexpr" or params[name].do_not_specialize:
            continue
        if ty.startswith("*") or ty in ("i32", "i64"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resource_usage(cubin: bytes) -> tuple[int, int] | None:
    """(registers, stack frame bytes = spills) per thread of the kernel, from the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _compile(job: tuple[str, int, int, bool]) -> tuple[str, int, str, str | None, bool | None, bool, int | None,
                                                      int, bool, bool]:
    """-> (module, cc, config name, error or None, PTX has griddepcontrol (None: no PDL constexpr),
    PTX has 16-byte vector loads, stack bytes per thread (JIT-aligned compiles only, else None), CTA barriers
    (bar.sync) in the PTX, PTX has an L2 prefetch, PTX has asynchronous copies (cp.async: Triton's pipeline))."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, i, cc, aligned = job
    c = importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()[i]
    name = c.name + (" (JIT-aligned)" if aligned else "")
    constexprs = dict(c.constexprs)
    if "PDL" in constexprs:
        constexprs["PDL"] = cc >= 90          # as triton_common.pdl() picks: griddepcontrol exists on sm90+
    attrs = jit_aligned_attrs(c) if aligned else None
    try:
        compiled = triton.compile(ASTSource(fn=c.kernel, signature=c.signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", cc, 32),
                                  options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
        ptx = compiled.asm["ptx"]
        gdc = ("griddepcontrol.wait" in ptx) if "PDL" in constexprs else None
        v4 = re.search(r"ld\.global(\.\w+)*\.v4\.(b32|u32|f32|s32)", ptx) is not None
        if not compiled.asm.get("cubin"):
            return mod, cc, name, "no cubin produced", gdc, v4, None, 0, False, False
        usage = resource_usage(compiled.asm["cubin"]) if aligned else None
        return (mod, cc, name, None, gdc, v4, usage[1] if usage else None, ptx.count("bar.sync"),
                "prefetch.global.L2" in ptx, "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx)
    except Exception as e:                                                 # reported by the test below
        return mod, cc, name, f"{type(e).__name__}: {str(e)[:2000]}", None, False, None, 0, False, False


@pytest.fixture(scope="module")
def compiled() -> list[tuple[str, int, str, str | None]]:
    jobs = _jobs()
    # heavy kernels first so the two workers finish together
    jobs.sort(key=lambda j: (j[0] not in ("fused_moe", "gptq_gemm"), j[2]))
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_compile, jobs))


def test_every_dispatcher_config_is_listed():
    """The dispatchers' choices are the configs listed for AOT (names of the fixed tables)."""
    from onecard.kernels.attention import triton as attn
    from onecard.kernels.fused_moe import triton as moe
    from onecard.kernels.gptq_gemm import triton as gemm
    assert {gemm.choose_config(m) for m in range(1, 5000)} == set(gemm._CONFIGS)
    assert {moe.choose_config(t, cc) for t in range(1, 5000) for cc in (70, 90)} == \
        set(moe._CONFIGS) | set(moe.DECODE_CONFIGS)
    names = {c.name for c in gemm.aot_configs()} | {c.name for c in moe.aot_configs()}
    assert all(f"w4a16[{n},fp16]" in names for n in gemm._CONFIGS)
    # the exact-integer dot's variants (paths.int_dot: T > 1, fp16 on sm80+)
    assert {"w4a16[skinny,int_dot,fp16]", "moe_decode[decode16,stage=1,int_dot,fp16]",
            "moe_decode[decode16,stage=2,int_dot,fp16]"} <= names
    # the batch-1 attention block's accumulating GEMVs and the launches around them (paths.batch1_accumulate)
    from onecard.kernels.norm import triton as norm
    from onecard.kernels.rope import triton as rope
    assert {"w4a16[gemv,accum,fp16]", "w4a16[gemv,per_row,accum,fp16]", "norm_route[renorm=True,x=fp32,fp16]"} <= names
    assert "rms_norm[2048,res=True,x=fp32,zero,fp16]" in {c.name for c in norm.aot_configs()}
    # the batch-1 MoE's one-launch expert stages (paths.batch1_moe_slices): the served g128 and groups of 32,
    # and routing themselves after a norm-route launch without its last arriver (paths.batch1_slices_route)
    assert {"moe_slices[g128,fp16]", "moe_slices[g32,fp16]", "moe_slices[g128,route,fp16]",
            "norm_route[renorm=True,x=fp32,noroute,fp16]"} <= names
    assert "paged_attn[bq=2,fp16,qkn]" in {c.name for c in attn.aot_configs()}
    assert "qk_norm_rope[store=True,src=fp32,fp16]" in {c.name for c in rope.aot_configs()}
    assert all(f"moe[{n},gated={g},float={f},fp16]" in names for n in moe._CONFIGS
               for g in (True, False) for f in (True, False))
    assert all(f"moe_decode[{n},stage={s},float={f},per_row={r},fp16]" in names for n in moe.DECODE_CONFIGS
               for s in (1, 2) for f, r in ((False, False), (False, True), (True, False)))
    assert all(f"w4a16[{n},per_row,fp16]" in names for n in ("gemv", "skinny"))
    bqs = {attn.block_q(8, q) for q in (1, 2, 3, 100, 10000)}
    assert {f"paged_attn[bq={b}{t},fp16{kv}]" for b in bqs for t in ("", ",pre-sm80") for kv in ("", ",kv=e5m2")} \
        | {f"paged_attn[bq={b},{a},kv=e4m3]" for b in bqs for a in ("fp16", "bf16")} <= {
        c.name for c in attn.aot_configs()}


def test_every_config_names_its_kernels_defaulted_arguments():
    """triton.compile takes a constexpr's default from nobody: a config that leaves one out compiles another
    variant than the JIT launches (found when the norm-route kernel gained ROUTE = True: its configs compiled the
    variant without the routing). Every argument with a default must be in the config."""
    import inspect
    missing = []
    for mod in MODULES:
        for c in importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs():
            params = inspect.signature(c.kernel.fn).parameters
            missing += [f"{c.name}: {n}" for n, p in params.items()
                        if p.default is not inspect.Parameter.empty and n not in c.constexprs]
    assert not missing, missing


def test_every_kv_format_compiles_for_its_targets(compiled):
    """fp8_e5m2 stores and attention compile for sm70/75/80/90; fp8_e4m3 (sm89+) for sm90 (the fused stores too)."""
    for kv, targets in ((",kv=e5m2", set(TARGETS)), (",kv=e4m3", {90})):
        for kernel in ("store_kv[", "paged_attn[", "qk_norm_rope[store=True"):
            ok = {r[1] for r in compiled if r[2].startswith(kernel) and kv in r[2] and r[3] is None}
            assert ok == targets, (kernel, kv, ok)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("cc", TARGETS)
def test_aot_compiles(compiled, module, cc):
    mine = [r for r in compiled if r[0] == module and r[1] == cc]
    assert mine, f"no configs for {module} at sm{cc}"
    failures = [f"{name}: {err}" for _, _, name, err, *_ in mine if err]
    assert not failures, "\n".join(failures)


def test_pdl_wait_is_compiled_in_on_sm90_only(compiled):
    """Kernels with a PDL constexpr carry griddepcontrol.wait on sm90 and none of it below (no such PTX)."""
    pdl = [r for r in compiled if r[4] is not None and r[3] is None]
    assert {r[1] for r in pdl} == set(TARGETS), "no PDL-capable kernels compiled"
    wrong = [f"sm{cc} {name}" for _, cc, name, _, gdc, *_ in pdl if gdc != (cc >= 90)]
    assert not wrong, wrong


def test_jit_aligned_variants_are_the_vectorized_code(compiled):
    """The JIT-aligned compiles are really other code: the int4 weight tiles load 16 bytes at a time there
    (as on the GPU), not in the plain compile."""
    by_name = {(r[1], r[2]): r for r in compiled}
    aligned = [r for r in compiled if r[2].endswith("(JIT-aligned)")]
    assert aligned and {r[1] for r in aligned} == set(JIT_ALIGNED_TARGETS)
    plain = [r for r in aligned if (r[1], r[2].removesuffix(" (JIT-aligned)")) in by_name]
    assert {r[2].removesuffix(" (JIT-aligned)") for r in plain} == set(PLAIN_SM70)
    gained = [r[2] for r in plain if r[5] and not by_name[(r[1], r[2].removesuffix(" (JIT-aligned)"))][5]]
    assert any(n.startswith("w4a16[gemv") for n in gained), gained
    assert any(n.startswith("moe_decode[decode1,stage=1") for n in gained), gained


def test_pre_sm80_tiles_do_not_spill(compiled):
    """Below sm80 tl.dot is FMA code holding its tiles in registers; the attention tiles, the MoE configs and the
    skinny GEMM's row step chosen there up to the per-expert cuBLAS prefill (attention.triton.attn_tiles, fused_moe.triton.choose_config)
    compile for sm70, as the JIT specializes them, with no stack frame (GPTQ without g_idx: the served
    checkpoint)."""
    from onecard.kernels import paths
    from onecard.kernels.fused_moe.grouped import GROUPED_MIN_TOKENS
    from onecard.kernels.fused_moe.stages import choose_decode_config
    from onecard.kernels.fused_moe.triton import choose_config

    chosen = {f"moe_decode[{choose_decode_config(t, 70)},stage={s},float=False,per_row=False,fp16]"
              for t in (1, 16) for s in (1, 2)}
    chosen.add(f"moe_decode[{choose_decode_config(16, 70)},stage=2,float=False,per_row=False,pre_act,fp16]")
    assert paths.decode_rows(16, 70) > 0                                  # T > 1: the compacted row step
    chosen |= {f"moe_decode[{choose_decode_config(16, 70)},stage={s},rows,fp16]" for s in (1, 2)}
    assert paths.dense_rows(2, 70) > 0                                    # the skinny GEMM at few rows too
    chosen.add("w4a16[skinny,rows,fp16]")
    chosen |= {f"moe[{choose_config(t, 70)},gated={g},float=False,fp16]"
               for t in range(17, GROUPED_MIN_TOKENS) for g in (True, False)}
    rows = [r for r in compiled if r[1] == 70 and r[2].endswith("(JIT-aligned)") and (
        (r[2].startswith("paged_attn") and "pre-sm80" in r[2]) or r[2].removesuffix(" (JIT-aligned)") in chosen
        or r[2].startswith("segment_reduce"))]
    # attention: decode, prefill, each with an fp16 and an fp8_e5m2 cache, and decode at the kernel's prefetch
    # levels 1 and 2 (fp16; bench/attn_sweep.py's A/B); MoE: decode 1, 16 (stage 2 also on the separate silu
    # launch's output, paths.decode_moe_act_launch), 16 on the row step (paths.decode_rows, both stages); sorted;
    # the skinny GEMM's row step (paths.dense_rows); the split-KV reduce at each BLOCK_S (2 .. 128 segments merged
    # per step), and its row-wise variant (split small-q launches) at BLOCK_Q 2, 8
    assert len(rows) == 2 * 2 + 2 + 4 + 1 + 2 + 2 + 1 + 7 + 7 * 2, [r[2] for r in rows]
    assert all(r[6] == 0 for r in rows), [(r[2], r[6]) for r in rows]


def test_slices_routing_reduces_inside_warps(compiled):
    """fused_moe/slices.py routing itself (decode.topk_slot_of, the logits once per warp) adds no more than the
    final cross-warp max's CTA barriers to the kernel, as the JIT compiles it (aligned logits: each row one warp);
    topk_of on one row over 8 warps added 30 (its 10 reductions' shared-memory rounds, ~2.5 µs in the model)."""
    bars = {r[2]: r[7] for r in compiled if r[1] == 70 and r[2].startswith("moe_slices[g128,")
            and r[2].endswith("(JIT-aligned)")}
    plain, route = bars["moe_slices[g128,fp16] (JIT-aligned)"], bars["moe_slices[g128,route,fp16] (JIT-aligned)"]
    assert route - plain <= 4, (plain, route)


def test_slices_pipelined_gate_up_streams_by_cp_async(compiled):
    """The sm80+ slices config (slices.SLICES_CONFIG, stages 3) is Triton's software pipeline of the gate/up loop:
    cp.async in its PTX on sm80 and sm90 (the loop asks for it with tl.range num_stages: Triton
    pipelines a loop without tl.dot only then), no stack frame; the shipped one-ahead loop has none."""
    rows = [r for r in compiled if r[2].startswith("moe_slices[g128,route,") and r[3] is None]
    piped = [r for r in rows if ",sm80+,stages" in r[2]]
    assert {r[1] for r in piped} == {cc for cc in TARGETS if cc >= 80}, piped
    assert all(r[9] for r in piped), [(r[1], r[2]) for r in piped if not r[9]]
    assert all(r[6] == 0 for r in piped if r[2].endswith("(JIT-aligned)"))
    assert not any(r[9] for r in rows if ",stages" not in r[2])


def test_folded_router_compiles_with_no_sm70_spill(compiled):
    """paths.batch1_router_fold's kernels (fused_moe/router_fold.py): the o_proj GEMV adding the router's folded
    sums (ROUTER) and the slices normalising their input and routing from those sums (NORM, both configs) compile
    for their targets and, as the JIT compiles them for sm70, with no stack frame."""
    names = ("w4a16[gemv,accum,router,fp16]", "moe_slices[g128,route,norm,fp16]",
             "moe_slices[g128,route,norm,sm80+,stages3,fp16]")
    for name in names:
        ok = {r[1] for r in compiled if r[2].removesuffix(" (JIT-aligned)") == name and r[3] is None}
        assert ok == {cc for cc in TARGETS if cc >= (80 if "sm80+" in name else 70)}, (name, ok)
    spills = [(r[2], r[6]) for r in compiled if r[2].removesuffix(" (JIT-aligned)") in names
              and r[2].endswith("(JIT-aligned)")]
    assert spills and all(s == 0 for _, s in spills), spills

