"""Ahead-of-time compile every Triton kernel at every block config its dispatcher can choose, for sm70,
sm75, sm80 and sm90, with no GPU (Triton's bundled ptxas). Catches pre-Ampere layout errors at CI time.

Configs come from each backend's ``aot_configs()``. fp16 variants compile for every target; bf16 variants
(sm80+ only) compile for sm90 alone: they take the same code path as sm80 and differ only in dtype.
Jobs run in 2 worker processes; Triton's on-disk cache makes repeated runs cheap.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest

triton = pytest.importorskip("triton")

MODULES = ["gptq_gemm", "fused_moe", "attention", "norm", "rope", "activation"]
TARGETS = [70, 75, 80, 90]


def _jobs() -> list[tuple[str, int, int]]:
    jobs = []
    for mod in MODULES:
        configs = importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()
        for i, c in enumerate(configs):
            is_bf16 = any(v == "*bf16" for v in c.signature.values())
            for cc in TARGETS:
                if cc >= c.min_cc and (not is_bf16 or cc == 90):
                    jobs.append((mod, i, cc))
    return jobs


def _compile(job: tuple[str, int, int]) -> tuple[str, int, str, str | None, bool | None]:
    """-> (module, cc, config name, error or None, PTX has griddepcontrol (None: no PDL constexpr))."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, i, cc = job
    c = importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()[i]
    constexprs = dict(c.constexprs)
    if "PDL" in constexprs:
        constexprs["PDL"] = cc >= 90          # as triton_common.pdl() picks: griddepcontrol exists on sm90+
    try:
        compiled = triton.compile(ASTSource(fn=c.kernel, signature=c.signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", cc, 32),
                                  options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
        gdc = ("griddepcontrol.wait" in compiled.asm["ptx"]) if "PDL" in constexprs else None
        if not compiled.asm.get("cubin"):
            return mod, cc, c.name, "no cubin produced", gdc
        return mod, cc, c.name, None, gdc
    except Exception as e:                                                 # reported by the test below
        return mod, cc, c.name, f"{type(e).__name__}: {str(e)[:2000]}", None


@pytest.fixture(scope="module")
def compiled() -> list[tuple[str, int, str, str | None]]:
    jobs = _jobs()
    # heavy kernels first so the two workers finish together
    jobs.sort(key=lambda j: (j[0] not in ("fused_moe", "gptq_gemm"), j[2]))
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_compile, jobs))


def test_every_dispatcher_config_is_listed():
    """The dispatchers' choices are the configs listed for AOT (names of the fixed tables)."""
    from onecard.kernels.fused_moe import triton as moe
    from onecard.kernels.gptq_gemm import triton as gemm
    from onecard.kernels.attention import triton as attn
    assert {gemm.choose_config(m) for m in range(1, 5000)} == set(gemm._CONFIGS)
    assert {moe.choose_config(t) for t in range(1, 5000)} == set(moe._CONFIGS) | set(moe.DECODE_CONFIGS)
    names = {c.name for c in gemm.aot_configs()} | {c.name for c in moe.aot_configs()}
    assert all(f"w4a16[{n},fp16]" in names for n in gemm._CONFIGS)
    assert all(f"moe[{n},gated={g},float={f},fp16]" in names for n in moe._CONFIGS
               for g in (True, False) for f in (True, False))
    assert all(f"moe_decode[{n},stage={s},float={f},per_row={r},fp16]" in names for n in moe.DECODE_CONFIGS
               for s in (1, 2) for f, r in ((False, False), (False, True), (True, False)))
    assert all(f"w4a16[{n},per_row,fp16]" in names for n in ("gemv", "skinny"))
    bqs = {attn.block_q(8, q) for q in (1, 2, 3, 100, 10000)}
    assert {f"paged_attn[bq={b},fp16]" for b in bqs} <= {c.name for c in attn.aot_configs()}


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("cc", TARGETS)
def test_aot_compiles(compiled, module, cc):
    mine = [r for r in compiled if r[0] == module and r[1] == cc]
    assert mine, f"no configs for {module} at sm{cc}"
    failures = [f"{name}: {err}" for _, _, name, err, _ in mine if err]
    assert not failures, "\n".join(failures)


def test_pdl_wait_is_compiled_in_on_sm90_only(compiled):
    """Kernels with a PDL constexpr carry griddepcontrol.wait on sm90 and none of it below (no such PTX)."""
    pdl = [r for r in compiled if r[4] is not None and r[3] is None]
    assert {r[1] for r in pdl} == set(TARGETS), "no PDL-capable kernels compiled"
    wrong = [f"sm{cc} {name}" for _, cc, name, _, gdc in pdl if gdc != (cc >= 90)]
    assert not wrong, wrong
