"""The kernel-path table (onecard/kernels/paths.py) and the emulation switch ONECARD_EMULATE_CC.

Each capability decision is asked at sm70/75/80/90 and must take the branch the kernels were built for
(documented in README/BENCHMARKS: cuBLAS prefill GEMMs from 65 rows below sm80, per-expert MoE below sm80, the
spill-free pre-sm80 tiles, PDL on sm90 only, bf16 grouped GEMM on sm90, bf16 from sm80); then the switch must
flip the one capability function, and everything that asks it (config's dtype rule, the Triton wrappers'
helpers, preflight's decision), on this CPU machine.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from onecard.config import ConfigError
from onecard.kernels import paths

PRE = (70, 75)
POST = (80, 90)


@pytest.fixture
def emulate(monkeypatch):
    """Set ONECARD_EMULATE_CC for this test (the environment is what a user sets; the cache is re-read)."""
    def set_(value: str | None):
        if value is None:
            monkeypatch.delenv("ONECARD_EMULATE_CC", raising=False)
        else:
            monkeypatch.setenv("ONECARD_EMULATE_CC", value)
        paths._env_emulation.cache_clear()
    yield set_
    monkeypatch.delenv("ONECARD_EMULATE_CC", raising=False)
    paths._env_emulation.cache_clear()
    paths.set_emulated_capability(None, clear=True)


@pytest.mark.parametrize("cc", PRE + POST)
def test_dense_gemm_cublas_threshold_by_capability(cc):
    first = 65 if cc < 80 else 128                     # tl.dot has no tensor cores below sm80: cuBLAS earlier
    assert paths.choose("dense_gemm", first - 1, cc) != "cublas"
    assert paths.choose("dense_gemm", first, cc) == "cublas"
    assert [paths.choose("dense_gemm", m, cc) for m in (1, 2, 16, 17)] == ["gemv", "skinny", "skinny", "tiled"]
    assert paths.choose("dense_gemm", 4096, cc, gpu=False) == "tiled"   # the interpreter has no cuBLAS path


@pytest.mark.parametrize("cc", PRE + POST)
def test_moe_paths_by_capability(cc):
    pre = cc < 80
    assert paths.choose("moe", 1, cc) == "decode1"
    assert paths.choose("moe", 16, cc) == ("decode16-pre-sm80" if pre else "decode16")
    assert paths.choose("moe", 17, cc) == "sorted16"
    assert paths.choose("moe", 65, cc) == ("sorted16" if pre else "sorted64")     # sorted64 spills on sm70
    assert paths.choose("moe", 255, cc) == ("sorted16" if pre else "sorted64")
    assert paths.choose("moe", 256, cc) == ("per-expert" if pre else "grouped")
    # no grouped-GEMM dtype works (the start-up probe found none): the Triton sorted GEMM serves sm80+
    assert paths.choose("moe", 4096, cc, grouped_dtypes=()) == ("per-expert" if pre else "sorted64")
    assert paths.choose("moe", 4096, cc, gpu=False) == ("sorted16" if pre else "sorted64")


def test_grouped_gemm_dtype():
    allofthem = ("float16", "bfloat16", "float32")
    assert paths.grouped_gemm_dtype("float16", 90, allofthem) == "bfloat16"     # CUTLASS grouped GEMM: bf16
    assert paths.grouped_gemm_dtype("float16", 80, allofthem) == "float16"
    assert paths.grouped_gemm_dtype("float32", 90, allofthem) == "float32"
    assert paths.grouped_gemm_dtype("float16", 80, ("bfloat16",)) == "bfloat16"  # fp16 does not run: bf16 does
    assert paths.grouped_gemm_dtype("float16", 90, ("float16",)) is None          # as before: bf16 or nothing
    assert paths.grouped_gemm_dtype("float16", 90, ()) is None


@pytest.mark.parametrize("cc", PRE + POST)
def test_tiles_pdl_and_dtype_rules_by_capability(cc):
    pre = cc < 80
    assert paths.attention_tiles(cc, 16) == ((32, 8) if pre else (64, 4))
    assert paths.attention_tiles(cc, 64) == ((16, 8) if pre else (64, 4))
    assert paths.use_pdl(1, cc, 1) is (cc >= 90)
    assert paths.use_pdl(2, cc, 1) is False and paths.use_pdl(1, cc, 0) is False
    assert paths.bf16_allowed(cc) is not pre
    assert paths.per_expert_moe(cc) is pre


def test_split_kv_legacy_policy_is_the_old_formula():
    def legacy(b, L, sms=132):
        return paths.split_kv(b, True, L, 4, sms, 90, "legacy")
    assert paths.split_kv(1, True, 1023, 4, 132, 90, "legacy") == (1, 1)        # short context: one segment
    assert paths.split_kv(1, False, 65536, 4, 132, 90, "legacy") == (1, 1)      # a prefill row in the batch
    assert legacy(1, 32768) == (16, 1)                                           # 2*132/4 = 66 -> 16 (cap)
    assert legacy(16, 8192) == (4, 1)                                            # 264 // 64 = 4
    assert legacy(12, 8192) == (8, 1)                                            # 264 // 48 = 5 -> pow2 8
    assert legacy(64, 8192) == (1, 1)                                            # 264 // 256 = 1


def _critical_path(base: int, tiles: int, wave: int, s: int) -> int:
    """The "fill" cost model, written out: waves of resident programs x (tiles per segment + overhead)."""
    waves = -(-base * s // wave)
    return waves * (-(-tiles // s) + paths.SPLIT_PROGRAM_OVERHEAD_TILES)


@pytest.mark.parametrize("sms,cc", [(132, 90), (132, 80), (80, 70)])
@pytest.mark.parametrize("batch,bound", [(1, 32768), (1, 65536), (1, 66560), (16, 8192), (16, 66560), (4, 4096),
                                         (12, 20000), (64, 8192), (128, 4096), (1, 1024)])
def test_split_kv_fill_minimises_the_critical_path(sms, cc, batch, bound):
    segs, min_tiles = paths.split_kv(batch, True, bound, 4, sms, cc, "fill")
    tiles = -(-bound // paths.attention_tiles(cc, 16)[0])
    wave = paths.split_kv_ctas_per_sm(cc) * sms
    assert min_tiles == paths.SPLIT_MIN_SEGMENT_TILES
    assert 1 <= segs <= min(paths.MAX_SEGMENTS, tiles)
    best = min(_critical_path(batch * 4, tiles, wave, s) for s in range(1, min(paths.MAX_SEGMENTS, tiles) + 1))
    assert _critical_path(batch * 4, tiles, wave, segs) == best
    assert all(_critical_path(batch * 4, tiles, wave, s) > best for s in range(1, segs))   # the fewest such
    if batch * 4 * 2 <= wave:                    # a batch that leaves half the wave idle is split to fill it
        assert batch * 4 * segs >= 0.75 * wave or segs == tiles


def test_split_kv_fill_numbers():
    """The counts the issue asks about (H100/H200: 132 SMs; V100: 80), before (legacy) and after (fill)."""
    def both(b, L, sms, cc):
        return tuple(paths.split_kv(b, True, L, 4, sms, cc, p)[0] for p in ("legacy", "fill"))
    assert both(1, 32768, 132, 90) == (16, 86)       # 64 -> 344 programs (86 x 6 tiles of 64 keys)
    assert both(1, 65536, 132, 90) == (16, 94)       # 64 -> 376 programs (94 x 11 tiles)
    assert both(16, 8192, 132, 90) == (4, 6)         # 256 -> 384 programs (6 x 22 tiles)
    assert both(1, 32768, 80, 70) == (16, 20)        # 64 -> 80 programs: one per V100 SM (8 warps fill it)
    assert both(16, 8192, 80, 70) == (2, 5)          # 128 -> 320 programs: 4 even waves
    assert paths.split_kv(1, True, 1023, 4, 132, 90, "fill") == (1, 1)
    assert paths.split_kv(1, False, 65536, 4, 132, 90, "fill") == (1, 1)


def test_split_kv_policy_switch(monkeypatch):
    paths._env_split_kv.cache_clear()
    monkeypatch.setenv("ONECARD_SPLIT_KV", "legacy")
    try:
        assert paths.split_kv_policy() == "legacy"
        assert paths.split_kv_segments(1, True, 32768, 4, 132) == 16
        paths.set_split_kv_policy("fill", ctas_per_sm=5)                         # a bench's override wins
        assert paths.split_kv_policy() == "fill" and paths.split_kv_ctas_per_sm(90) == 5
        paths.set_split_kv_policy(None)
        assert paths.split_kv_policy() == "legacy"
        monkeypatch.setenv("ONECARD_SPLIT_KV", "fastest")
        paths._env_split_kv.cache_clear()
        with pytest.raises(ConfigError, match="ONECARD_SPLIT_KV=fastest"):
            paths.split_kv_policy()
        with pytest.raises(ValueError):
            paths.set_split_kv_policy("fastest")
    finally:
        paths.set_split_kv_policy(None)
        paths._env_split_kv.cache_clear()


def test_attention_launch_is_the_table_unless_overridden():
    """paths.attention_launch: the table's tiles, stages, split and reduce; the bench/test override replaces the
    knobs of decode-only launches only, and clearing it restores the table."""
    def launch(decode_only=True, b=1, bound=65536, cc=90):       # not decode-only: a 512-row prefill chunk
        return paths.attention_launch(b, decode_only, bound, 4, 132, cc, 16, 1 if decode_only else 512, 32)

    d = launch()
    segs = paths.split_kv(1, True, 65536, 4, 132, 90)[0]
    assert d == paths.AttentionLaunch(segs, paths.SPLIT_MIN_SEGMENT_TILES, paths.ATTN_BLOCK_N, paths.ATTN_WARPS,
                                      paths.ATTN_STAGES, min(paths.next_pow2(segs), paths.REDUCE_BLOCK_S),
                                      paths.DECODE_REDUCE_WARPS, paths.ATTN_PREFETCH,
                                      reduce_d_split=paths.REDUCE_D_SPLIT)
    assert launch(cc=70)[2:4] == paths.attention_tiles(70, 16)
    assert launch(b=16, bound=8192).reduce_block_s == paths.next_pow2(launch(b=16, bound=8192).segments)
    prefill = launch(decode_only=False)
    assert prefill.segments == 1 and prefill[2:4] == paths.attention_tiles(90, 16)
    try:
        paths.set_decode_attention_override(block_n=128, num_warps=8, num_stages=3, reduce_block_s=128,
                                            reduce_warps=8, prefetch=2)
        o = launch()
        assert o[2:8] == (128, 8, 3, min(paths.next_pow2(o.segments), 128), 8, 2)
        tiles = 65536 // 128                                              # fill counts tiles of the new block_n
        assert o.segments == paths._fill_segments(4, tiles, paths.SPLIT_CTAS_PER_SM * 132)
        assert launch(decode_only=False) == prefill                       # prefill launches keep the table
        paths.set_decode_attention_override(segments=7, min_seg_tiles=3)
        assert launch()[:2] == (7, 3) and launch(bound=512)[:2] == (7, 3)  # forced, even below SPLIT_MIN_SEQ_LEN
        assert launch().reduce_block_s == 8 and launch(decode_only=False) == prefill
        assert paths.decode_attention_override() == {"segments": 7, "min_seg_tiles": 3}
        with pytest.raises(ValueError, match="unknown decode-attention knobs"):
            paths.set_decode_attention_override(block_m=32)
    finally:
        paths.set_decode_attention_override()
    assert launch() == d and paths.decode_attention_override() == {}


def test_small_q_split_is_on_by_default_and_splits_exactly_small_q_launches():
    """Split-KV of small-q launches (verify steps): on by default (since the H100 A/B); off, every launch is the
    earlier plan (decode-only split, nothing else); on, exactly the launches that are not decode-only with at most
    SPLIT_MAX_QUERY rows per sequence and a bound from SPLIT_MIN_SEQ_LEN split, counted as a decode launch of B x
    q-blocks sequences, with the row-wise reduce; decode-only launches keep their own plan either way."""
    def launch(decode_only, b, bound, q, qblocks, cc=90):
        return paths.attention_launch(b, decode_only, bound, 4, 132, cc, 64 if q > 2 else 16, q, qblocks)

    shapes = [(b, bound, q, -(-q // (2 if q <= 2 else 8))) for b in (1, 4, 16) for bound in (512, 8192, 65536)
              for q in (1, 2, 3, 9, 16, 17, 64)]
    assert paths.SPLIT_SMALL_Q is True and paths.small_q_split() is True
    try:
        paths.set_switch("small_q_split", False)
        for b, bound, q, qb in shapes:                                        # off: the earlier plans
            assert launch(False, b, bound, q, qb) == paths.attention_launch(b, False, bound, 4, 132, 90,
                                                                            64 if q > 2 else 16)
            assert launch(False, b, bound, q, qb).segments == 1
            assert launch(True, b, bound, 1, 1) == paths.attention_launch(b, True, bound, 4, 132, 90, 16)
        decode = {(b, bound): launch(True, b, bound, 1, 1) for b, bound, _, _ in shapes}
        paths.set_switch("small_q_split", True)
        assert paths.small_q_split() is True
        for b, bound, q, qb in shapes:
            got = launch(False, b, bound, q, qb)
            small = q <= paths.SPLIT_MAX_QUERY and bound >= paths.SPLIT_MIN_SEQ_LEN
            want = paths.split_kv(b * qb, True, bound, 4, 132, 90)[0] if small else 1
            assert got.segments == want and got.row_reduce == (want > 1), (b, bound, q, got)
            assert launch(True, b, bound, 1, 1) == decode[(b, bound)] and not decode[(b, bound)].row_reduce
        assert launch(False, 1, 32768, 9, 2).segments > 1                 # the verify step the switch is for
        assert launch(False, 1, 32768, 17, 3).segments == 1               # a prefill chunk's launch: unsplit
        # sm70: the fill count uses the launch's own tiles (16 keys for 64-row programs)
        sm70 = launch(False, 1, 32768, 9, 2, cc=70)
        assert sm70[2:4] == paths.attention_tiles(70, 64)
        assert sm70.segments == paths._fill_segments(8, 32768 // 16, paths.SPLIT_CTAS_PER_SM_PRE_AMPERE * 132)
        paths.set_decode_attention_override(segments=7)                  # decode-only knobs leave small-q alone
        assert launch(False, 1, 32768, 9, 2).segments == paths._fill_segments(8, 32768 // 64,
                                                                              paths.SPLIT_CTAS_PER_SM * 132)
    finally:
        paths.set_switch("small_q_split", None)
        paths.set_decode_attention_override()
    assert paths.small_q_split() is True


def test_boundaries_are_where_paths_change():
    b = paths.token_boundaries()
    assert b == [2, 17, 65, 128, 256]
    for t in b:
        assert any(paths.choose(op, t - 1, cc) != paths.choose(op, t, cc) for op in paths.OPS
                   for cc in paths.CAPABILITIES)


def test_describe_reads_the_table():
    pre, post = paths.describe(70, True), paths.describe(90, True)
    assert f">= {paths.CUBLAS_MIN_M_PRE_AMPERE} tokens" in pre["dense_gemm"]
    assert f">= {paths.DENSE_CUBLAS_MIN_M} tokens" in post["dense_gemm"]
    assert "per expert" in pre["moe"] and "grouped GEMM in bf16" in post["moe"]
    assert "PDL" in post["attention"] and "PDL" not in paths.describe(80, True)["attention"]


@pytest.mark.parametrize("cc", [70, 75, 80, 90])
def test_switch_flips_the_one_capability_function(emulate, cc):
    import torch

    from onecard.config import Env
    from onecard.kernels.triton_common import compute_capability, pdl

    emulate(None)
    assert paths.capability(torch.device("cpu")) == paths.INTERPRETER_CC and Env.read().emulate_cc is None
    emulate(str(cc))
    assert Env.read().emulate_cc == cc
    assert paths.capability(torch.device("cpu")) == cc == compute_capability(torch.device("cpu"))
    assert paths.capability() == cc                                             # no device asked at all
    assert pdl(torch.device("cpu"), 1) is False                                 # PDL needs a real GPU too


@pytest.mark.parametrize("cc,want", [("70", "float16"), ("75", "float16"), ("80", "bfloat16"), ("90", "bfloat16")])
def test_switch_flips_the_dtype_rule(emulate, cc, want):
    """--dtype auto of a bf16 checkpoint on a GPU: fp16 below sm80 (as vLLM), asked through the one function."""
    from onecard.config import EngineArgs

    emulate(cc)
    assert EngineArgs(model="x")._resolve_dtype({"torch_dtype": "bfloat16"}, None, "cuda") == want


def test_switch_reaches_preflight_decision(emulate):
    """preflight asks paths.capability for the card; emulated sm70 refuses bf16 as on a V100."""
    from onecard.hardware import decide
    from onecard.preflight import _detect

    emulate("70")
    cc, *_ = _detect(None, 1, 1, [])
    assert cc == (7, 0)
    assert not decide(cc, "bfloat16", None, "auto").allowed


@pytest.mark.parametrize("bad", ["65", "sm100", "x"])
def test_switch_rejects_unknown_capabilities(emulate, bad):
    from onecard.config import ConfigError, Env

    emulate(bad)
    with pytest.raises(ConfigError, match="ONECARD_EMULATE_CC"):
        Env.read()


def test_one_capability_function():
    """Nothing but kernels/paths.py asks torch for the compute capability (so the switch reaches everything)."""
    root = Path(paths.__file__).resolve().parents[1]
    offenders = []
    for f in root.rglob("*.py"):
        if f.name == "paths.py" and f.parent.name == "kernels":
            continue
        text = f.read_text()
        if re.search(r"get_device_capability|\.major\b", text):
            offenders.append(str(f.relative_to(root)))
    # hardware.py reads the device properties for the probe's name and memory, not the capability
    assert offenders == [], offenders


def test_switches_are_one_mechanism_with_their_shipped_values():
    """Every on/off switch reads its module constant's shipped value until a process overrides it; None restores
    it; an unknown name is refused (a benchmark's typo must not measure the shipped path by mistake); and the
    decision functions answer from the same switch."""
    shipped = paths.switches()
    constants = {"batch1_accumulate": paths.BATCH1_ACCUMULATE, "decode_moe_act_launch": paths.DECODE_MOE_ACT_LAUNCH,
                 "batch1_moe_slices": paths.BATCH1_MOE_SLICES, "small_q_split": paths.SPLIT_SMALL_Q,
                 "decode_int_dot": paths.DECODE_INT_DOT}
    assert {k: shipped[k] for k in constants} == constants
    try:
        for name, value in shipped.items():
            paths.set_switch(name, not value)
        assert paths.switches() == {k: not v for k, v in shipped.items()}
        assert paths.batch1_accumulate(1) is (not paths.BATCH1_ACCUMULATE)
        assert paths.batch1_accumulate(2) is False                      # batch 1 only, whatever the switch
        assert paths.small_q_split() is (not paths.SPLIT_SMALL_Q)
        assert paths.int_dot(16, 90) is (not paths.DECODE_INT_DOT) and paths.int_dot(16, 70) is False
    finally:
        for name in shipped:
            paths.set_switch(name, None)
    assert paths.switches() == shipped
    with pytest.raises(ValueError, match="unknown switch 'batch1_moe_slice'"):
        paths.set_switch("batch1_moe_slice", True)


def test_moe_slices_take_the_served_weights_and_refuse_what_they_cannot_cut():
    """fused_moe/slices.py's host rules (paths.batch1_moe_slices): the served g128 experts are taken, slices cut
    to the down projection's group, and act order, float experts or groups of no power-of-two packed rows fall
    back to the two-launch stages."""
    import torch

    from onecard.kernels.fused_moe import slices
    from onecard.kernels.types import GPTQWeight

    def w(k: int, n: int, gs: int, e: int = 2, g_idx: bool = False) -> GPTQWeight:
        groups = -(-k // gs)
        return GPTQWeight(torch.zeros(e, k // 8, n, dtype=torch.int32), torch.zeros(e, groups, n // 8, dtype=torch.int32),
                          torch.zeros(e, groups, n, dtype=torch.float16),
                          torch.zeros(e, k, dtype=torch.int32) if g_idx else None, gs, k, n)

    gate, up, down = w(2048, 768, 128), w(2048, 768, 128), w(768, 2048, 128)   # the served shape
    assert slices.supported(gate, up, down) and slices.group_k8(gate) == 16
    assert slices.slice_rows(down, slices.SLICES_CONFIG[0]) == slices.SLICES_CONFIG[0]
    assert slices.slice_rows(w(768, 2048, 16), 32) == 16               # a slice's rows lie in one group
    assert slices.slice_rows(w(768, 2048, 768), 32) == 32             # channelwise: any slice
    assert slices.slice_rows(w(768, 2048, 24), 32) == 8
    assert slices.slice_rows(w(768, 2048, 12), 32) == 0
    assert slices.group_k8(w(2048, 768, 2048)) == 256                 # channelwise gate/up: one group
    assert not slices.supported(w(2048, 768, 96), w(2048, 768, 96), down)   # 12 packed rows a group
    assert not slices.supported(w(2048, 768, 128, g_idx=True), up, down)
    assert not slices.supported(torch.zeros(2, 2048, 768), up, down)
    assert not slices.supported(gate, up, w(768, 2048, 12))


def test_slices_config_by_capability():
    """The MoE slices' config is the one place a capability picks: SLICES_CONFIG where Triton can pipeline loads
    through shared memory (cp.async, sm80+), the pre-Ampere one below, whose gate/up loop is the one-ahead loop
    (stages 1: Triton would load a tile in place there). ONECARD_EMULATE_CC=70 takes the latter on any card."""
    from onecard.kernels.fused_moe import slices

    assert [paths.pipelined_loads(cc) for cc in (70, 75, 80, 86, 90)] == [False, False, True, True, True]
    assert slices.config(70) is slices.SLICES_CONFIG_PRE_AMPERE and slices.config(75) is slices.SLICES_CONFIG_PRE_AMPERE
    assert slices.config(80) is slices.SLICES_CONFIG and slices.config(90) is slices.SLICES_CONFIG
    assert slices.SLICES_CONFIG_PRE_AMPERE[4] == 1


def test_kv_prefetch_reads_its_budget_in_whole_chunks_at_batch_1_only():
    """paths.BATCH1_KV_PREFETCH (off until measured): batch 1 only; the served layer (4 KV heads, D 128, fp16: 2 KB
    of K and V a position) reads KV_PREFETCH_MB of its first positions, whole chunks; a tiny layer at least one."""
    assert paths.switches()["batch1_kv_prefetch"] is paths.BATCH1_KV_PREFETCH is False
    positions = paths.kv_prefetch_positions(4, 128, 2)
    assert positions == paths.KV_PREFETCH_MB * 2**20 // 2048 and positions % paths.KV_PREFETCH_CHUNK == 0
    assert paths.kv_prefetch_positions(4096, 128, 4) == paths.KV_PREFETCH_CHUNK
    paths.set_switch("batch1_kv_prefetch", True)
    try:
        assert paths.batch1_kv_prefetch(1) and not paths.batch1_kv_prefetch(2)
    finally:
        paths.set_switch("batch1_kv_prefetch", None)
    assert not paths.batch1_kv_prefetch(1)


def test_pre_ampere_paths_take_the_row_step_and_sdpa_only_below_sm80():
    """Below sm80 (tl.dot is FMA code) the decode MoE at 1 < T <= 16 takes the compacted row step
    (paths.decode_rows) and prefill chunks past the verify rows take SDPA (paths.prefill_sdpa); from sm80 neither;
    their switches give back the 16-row dot and the Triton attention."""
    assert paths.switches()["pre_ampere_decode_rows"] is paths.PRE_AMPERE_DECODE_ROWS is True
    assert paths.switches()["prefill_sdpa"] is paths.PREFILL_SDPA is True
    for cc in (70, 75):
        assert [paths.decode_rows(t, cc) for t in (1, 2, 16, 17)] == [0, 2, 2, 0]
        assert [paths.prefill_sdpa(n, cc) for n in (1, 16, 17, 4096)] == [False, False, True, True]
    for cc in (80, 86, 89, 90):
        assert paths.decode_rows(16, cc) == 0 and not paths.prefill_sdpa(4096, cc)
    paths.set_switch("pre_ampere_decode_rows", False)
    paths.set_switch("prefill_sdpa", False)
    try:
        assert paths.decode_rows(16, 70) == 0 and not paths.prefill_sdpa(4096, 70)
    finally:
        paths.set_switch("pre_ampere_decode_rows", None)
        paths.set_switch("prefill_sdpa", None)
