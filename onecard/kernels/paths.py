"""The kernel-path table: every capability- and size-dependent choice of a kernel path, and the one function
that answers "which compute capability is this?".

Contract: the ``choose_*`` functions are pure functions of (tokens, capability[, what is available]) and
return a path name; the thresholds they use are the constants below. ``dispatch.py``, the Triton wrappers,
``runner/precompile.py`` (dry shapes: ``token_boundaries``), ``plan.py`` (activation estimate) and
``hardware.py`` (``onecard probe``'s description: ``describe``) read them; nothing else keeps a copy.
Capabilities are ints (70 = sm70). ``capability(device)`` is the only place that asks the device (through
torch, imported lazily: this module imports nothing heavy) and the only place that honours the emulation
switch ``ONECARD_EMULATE_CC`` (``env.Env.emulate_cc``): with it every decision here takes that
capability's branch while Triton still compiles for the real card (Triton asks its own driver, not us).

Paths (``choose(op, tokens, cc)``):
  dense_gemm  gemv (M = 1) | skinny (M <= SMALL_M_MAX) | tiled | cublas (dequantize + torch.matmul: on a GPU
              at M >= DENSE_CUBLAS_MIN_M, below sm80 already at M >= CUBLAS_MIN_M_PRE_AMPERE: tl.dot has no
              tensor cores there)
  moe         decode1 | decode16 | decode16-pre-sm80 (T <= DECODE_MAX_TOKENS) | sorted16 | sorted64 (Triton
              sorted GEMM; sorted16 up to SORTED16_MAX_TOKENS, and always below sm80: sorted64 spills there)
              | grouped (PyTorch grouped GEMM, T >= GROUPED_MIN_TOKENS, sm80+, where the start-up probe found a
              working grouped-GEMM dtype) | per-expert (same T below sm80: one cuBLAS GEMM per expert)
Other decisions: ``attention_tiles`` (BLOCK_N, warps by capability), ``split_kv`` (split-KV decode attention:
segments and the shortest segment; policy ``ONECARD_SPLIT_KV``, see ``split_kv``; small-q launches only while
``small_q_split()``), ``attention_launch`` (the whole
paged-attention launch: tiles, stages, split, the segment reduce, the kernel's prefetch level; benchmarks and tests
replace its decode-only knobs through ``set_decode_attention_override``, the one hook), ``use_pdl``
(programmatic dependent launch: sm90+, decode-sized launches), ``grouped_gemm_dtype`` (bf16 on sm90+ for
fp16 inputs), ``bf16_allowed`` (the dtype rule: sm80+).

On/off switches: each is a module constant defined by ``_switch(name, shipped)`` beside the comment that says what
it does and the measurement that set it; the decision functions read ``switch(name)``, tests and benchmarks
override it in a process with ``set_switch(name, on)`` (None: the shipped value again), ``switches()`` lists them.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, ClassVar, NamedTuple

# the values ONECARD_EMULATE_CC and ONECARD_SPLIT_KV accept (their home: env.py, which reads them)
from onecard.env import CAPABILITIES, SPLIT_KV_POLICIES


# ---------------------------------------------------------------- on/off switches (one mechanism)
class _Switches:
    """The table's on/off switches: name -> the shipped value (registered by ``_switch`` where each is defined,
    with the measurement that set it), and name -> this process's override (``set_switch``: tests, benches;
    serving never sets one)."""

    shipped: ClassVar[dict[str, bool]] = {}
    on: ClassVar[dict[str, bool]] = {}


def _switch(name: str, shipped: bool) -> bool:
    """Register switch ``name`` with its shipped value, which it returns (the module constant keeps it)."""
    assert name not in _Switches.shipped, f"switch {name!r} defined twice"
    _Switches.shipped[name] = shipped
    return shipped


def set_switch(name: str, on: bool | None) -> None:
    """Switch ``name`` (one of ``switches()``) on or off in this process; None: back to its shipped value.
    Launches decide at launch time: CUDA graphs keep what they were captured with."""
    if name not in _Switches.shipped:
        raise ValueError(f"unknown switch {name!r}; known: {sorted(_Switches.shipped)}")
    if on is None:
        _Switches.on.pop(name, None)
    else:
        _Switches.on[name] = bool(on)


def switch(name: str) -> bool:
    """Is switch ``name`` on in this process (its override, else its shipped value)?"""
    return _Switches.on.get(name, _Switches.shipped[name])


def switches() -> dict[str, bool]:
    """Every switch's name and its value in this process now (reports, benches)."""
    return {name: switch(name) for name in sorted(_Switches.shipped)}


INTERPRETER_CC = 80                   # TRITON_INTERPRET on the CPU counts as sm80 (exercises the tensor-core paths)

TENSOR_CORE_DOT_MIN_CC = 80           # tl.dot uses tensor cores from sm80 (Triton >= 3.2 dropped MMAv1)
BF16_MIN_CC = 80                      # bf16 arithmetic (as vLLM: bf16 needs sm80+)
PDL_MIN_CC = 90                       # griddepcontrol (programmatic dependent launch)
PIPELINED_LOADS_MIN_CC = 80           # cp.async: Triton's software pipeline streams loads into shared memory
GROUPED_BF16_MIN_CC = 90              # PyTorch's fast grouped GEMM (CUTLASS) takes bf16 only, sm90+

SMALL_M_MAX = 16                      # dense GEMM: split-K GEMV / skinny kernel up to this M
DENSE_CUBLAS_MIN_M = 128              # dense GEMM: dequantize + cuBLAS from this M, on every GPU
CUBLAS_MIN_M_PRE_AMPERE = 65          # ... and below sm80 already from this M
DECODE_MAX_TOKENS = 16                # fused MoE: the split-K decode kernels up to this many tokens
SORTED16_MAX_TOKENS = 64              # fused MoE: sorted16 up to here (sm80+), sorted64 above
GROUPED_MIN_TOKENS = 256              # fused MoE: dequantize + grouped / per-expert cuBLAS GEMM from here
SPLIT_MIN_SEQ_LEN = 1024              # attention: split-KV only pays off for long decode contexts
MAX_SEGMENTS = 128                    # attention: split-KV segments at most (the partials' workspace bound)
LEGACY_MAX_SEGMENTS = 16              # ... under the "legacy" policy (the one before issue 25's tuning)
# Split-KV of small-q launches (speculative verify steps: every sequence 1 + k <= SPLIT_MAX_QUERY rows). Measured
# (BENCHMARKS.md, H100, 2026-12-06, bench/spec_verify.py --split-small-q ab, graphed verify steps, ms off -> on):
# batch 1 at 32k t=2..9 47-54 -> 5.4-7.4, at 8k 14-16 -> 4.2-5.7; batch 16 at 8k t=2 31.3 -> 23.2, t=9 52.8 -> 51.4;
# decode (t=1) unchanged. ``set_switch("small_q_split", False)`` turns it off (A/Bs).
SPLIT_MAX_QUERY = 16
SPLIT_SMALL_Q = _switch("small_q_split", True)
# Resident decode-attention CTAs per SM that split-KV aims to fill (one wave): sm80+ tiles (64 keys, 4 warps) at
# the served shape compile for sm90 to 96 registers / 38 KB shared (fp16 KV: 5 fit) and 164 registers / 22 KB
# (fp8_e5m2 KV: 3 fit), so 3 is one full wave for both; below sm80 (32 keys, 8 warps, 210 registers) 1 fits.
SPLIT_CTAS_PER_SM, SPLIT_CTAS_PER_SM_PRE_AMPERE = 3, 1
SPLIT_PROGRAM_OVERHEAD_TILES = 1      # split-KV cost model: a program's fixed cost (q, partials), in key tiles
SPLIT_MIN_SEGMENT_TILES = 1           # the shortest segment, in key tiles (ATTN_BLOCK_N keys each)
ATTN_BLOCK_N, ATTN_WARPS = 64, 4      # attention tiles, sm80+
ATTN_STAGES = 2                       # attention's Triton num_stages (sm80+: cp.async one key tile ahead)
ATTN_PREFETCH = 0                     # attention's own prefetch level (kernel PREFETCH; 1, 2: unmeasured, A/B)
# split-KV reduce: segments merged per step (at most), warps. 128 >= MAX_SEGMENTS: one pass, whatever the count.
# Measured (BENCHMARKS.md, H100, 2026-12-06, bench/attn_sweep.py + bench/long_context.py --sweep): against 32,
# the reduce's serial loop of dependent loads goes from 3 passes to 1 at 32k: attention 35.0 -> 32.4 us/launch,
# decode bs1 32k 256 -> 271 tok/s, 64k 199 -> 211; bs1 512 -0.6% (a 128-wide tile for 9 filled segments),
# bs16 unchanged (6 segments: 8). No spills at sm70 (tests/kernels/test_aot.py).
REDUCE_BLOCK_S, REDUCE_WARPS = 128, 4
# The decode-only reduce (one query row per sequence) in programs of one warp, each merging a 1/REDUCE_D_SPLIT
# share of a head's D columns: its reductions over the segments stay inside the warp (shuffles; sm90 PTX at 128
# segments: 2 bar.sync against 13 for 4 warps on whole rows; 168 registers, no sm70 spill), for 4x the programs,
# each reading every segment's (m, l). The row-wise reduce of small-q launches keeps REDUCE_WARPS on whole rows.
# Measured (H100, 2026-12-07, bench/run_h200.sh ab, the old paths.py + attention/triton.py as the base arm, one
# process per arm and run, alternating; BENCHMARKS.md): batch 16 at 512 tokens 3,120 / 3,123 -> 3,145 / 3,145
# tok/s (+0.8%), batch 1 at 512 469.2 / 468.7 -> 467.1 / 468.6 and at 32k 312.3 / 311.2 -> 312.2 / 311.6 (within
# the runs' spread); decode attention alone B=1 8k 9.7 -> 8.7 µs, B=16 8k 98.3 -> 97.3.
REDUCE_D_SPLIT, DECODE_REDUCE_WARPS = 4, 1

OPS = ("dense_gemm", "moe")


# ---------------------------------------------------------------- the capability question (one function)
class _Emulation:
    """Set by ``set_emulated_capability`` (tests, benches); unset: read once from config.Env."""

    override: int | None = None
    overridden = False


def set_emulated_capability(cc: int | None, *, clear: bool = False) -> None:
    """Emulate capability ``cc`` (None: the real one) in this process, overriding ONECARD_EMULATE_CC;
    ``clear=True`` drops the override (the environment decides again)."""
    if cc is not None and cc not in CAPABILITIES:
        raise ValueError(f"emulated capability {cc} is not one of {CAPABILITIES}")
    _Emulation.override, _Emulation.overridden = cc, not clear


@functools.lru_cache(maxsize=1)
def _env_emulation() -> int | None:
    from onecard.env import Env  # the one reader of the environment

    return Env.read().emulate_cc


def emulated_capability() -> int | None:
    return _Emulation.override if _Emulation.overridden else _env_emulation()


@functools.cache
def device_props(index: int) -> tuple[int, int]:
    """(real compute capability, SM count) of CUDA device ``index``; read once (no GPU sync)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    return p.major * 10 + p.minor, p.multi_processor_count


def _index(device: Any) -> int:
    idx = getattr(device, "index", device)
    if idx is None:
        import torch

        return torch.cuda.current_device()
    return int(idx)


def capability(device: Any = None) -> int:
    """THE compute capability every decision uses, like 90 for sm90. ``device``: a torch.device, a CUDA
    index, or None (the current CUDA device). A non-CUDA device is the Triton interpreter: INTERPRETER_CC.
    ONECARD_EMULATE_CC (or set_emulated_capability) replaces the answer for every device."""
    emu = emulated_capability()
    if emu is not None:
        return emu
    if device is not None and getattr(device, "type", "cuda") != "cuda":
        return INTERPRETER_CC
    return device_props(_index(device))[0]


def real_capability(device: Any = None) -> int:
    """The card's own capability, ignoring emulation: only for reporting it (probe) and for Triton targets."""
    return device_props(_index(device))[0]


def as_int(cc: tuple[int, int] | int | None) -> int | None:
    """(7, 0) -> 70; ints pass; None stays None."""
    if cc is None or isinstance(cc, int):
        return cc
    return int(cc[0]) * 10 + int(cc[1])


# ---------------------------------------------------------------- decisions
def tensor_core_dot(cc: int) -> bool:
    return cc >= TENSOR_CORE_DOT_MIN_CC


def bf16_allowed(cc: int) -> bool:
    return cc >= BF16_MIN_CC


def pipelined_loads(cc: int) -> bool:
    """Can a loop's loads be pipelined through shared memory (Triton's num_stages; below sm80 it loads in place)?"""
    return cc >= PIPELINED_LOADS_MIN_CC


def dense_cublas_min_m(cc: int) -> int:
    return DENSE_CUBLAS_MIN_M if tensor_core_dot(cc) else CUBLAS_MIN_M_PRE_AMPERE


def choose_dense_gemm(m: int, cc: int, gpu: bool = True) -> str:
    """W4A16 dense GEMM of M rows. ``gpu``: cuBLAS exists (not the interpreter)."""
    if gpu and m >= dense_cublas_min_m(cc):
        return "cublas"
    return triton_gemm_config(m)


def triton_gemm_config(m: int) -> str:
    """The Triton GEMM's block config (gptq_gemm/triton._CONFIGS) for M rows."""
    if m == 1:
        return "gemv"
    return "skinny" if m <= SMALL_M_MAX else "tiled"


def choose_decode_moe(tokens: int, cc: int) -> str:
    """The decode MoE's config (fused_moe/stages.DECODE_CONFIGS), T <= DECODE_MAX_TOKENS. Below sm80 decode16
    on 2 warps spills (tl.dot is FMA code there); 4 warps do not."""
    if tokens == 1:
        return "decode1"
    return "decode16" if tensor_core_dot(cc) else "decode16-pre-sm80"


# A decoder layer's attention block at batch 1 with its two GEMVs accumulating (attn_in/triton.attention_block):
# the input RMSNorm zeroes one fp32 row [N_qkv + H]; the qkv and o_proj GEMVs' K splits add their partial sums
# into it with fp32 atomics (no partials, no arrival counter, no last-arriving program that reads the partials
# back and rounds them: two dependent round trips to L2 off each GEMV's critical path); qk_norm_rope_store and
# the next RMSNorm / norm_moe read the fp32 sums. Numerics: the GEMVs' outputs are not rounded to the model
# dtype before the q/k norm and the residual add, and the order of the splits' fp32 additions varies (as the
# decode MoE's stages' already does). ON from 2026-12-06 (H100, bench/run_h200.sh switchab, one engine,
# alternating; BENCHMARKS.md): batch 1 at 512 tokens 420.1 -> 438.5 tok/s, at 32k 286.9 -> 296.9, batch 16
# unchanged, the same greedy tokens. ``set_switch("batch1_accumulate", False)`` turns it off in a process.
BATCH1_ACCUMULATE = _switch("batch1_accumulate", True)


def batch1_accumulate(tokens: int) -> bool:
    """Does a ``tokens``-token forward run its attention blocks with accumulating GEMVs (batch 1 only)?"""
    return tokens == 1 and switch("batch1_accumulate")


# The batch-1 attention block's q/k RMSNorm + RoPE and K/V store inside the paged-attention launch
# (attention/triton.py QKN: every program normalises and rotates its query rows, the program holding the new key
# stores k and v and uses them in place of that cache row) instead of a launch of its own (qk_norm_rope_store):
# one launch fewer per layer. With BATCH1_ACCUMULATE's path only, decode steps, model-dtype caches, sm80+ (its
# first version's pre-sm80 tiles compiled for sm70 to 255 registers and 360 B of stack per thread). ON from
# 2026-12-06 (H100, switchab): batch 1 at 512 tokens 439.3 -> 441.3 tok/s, at 32k 297.1 -> 297.8. (The first
# version patched the new K/V into the tiles from registers: 168 registers on sm90 against 92 now, +1.5% at 512
# but -2.4% at 32k.) ``set_switch("batch1_attn_qk", False)`` turns it off in a process.
BATCH1_ATTN_QK = _switch("batch1_attn_qk", True)


def batch1_attn_qk(cc: int) -> bool:
    """Does the batch-1 attention block's paged attention normalise, rotate and store q/k itself (sm80+)?"""
    return tensor_core_dot(cc) and switch("batch1_attn_qk")


# Not kept (measured and removed; BENCHMARKS.md): decode attention loading each segment's first key tile before
# the PDL wait (H100, 2026-12-06, switchab: batch 1 at 512 tokens +0.6%, at 32k -12%: sm90 164 registers against
# 90, the tile held across the wait); and split-KV decode attention merging its own segments in the last program to
# arrive instead of the reduce launch (H100, 2026-12-07, decode10: batch 1 at 512 tokens 444.6 -> 381.0 tok/s,
# batch 16 3,132 -> 2,791; the last arriver's merge of GROUP heads is a serial tail longer than the launch it
# saves); that merge spread over the o_proj GEMV's programs lost too (457.1 -> 427.7). Under PDL the reduce
# launch costs little; the chain's dependent L2 round trips are what cost.


# Not kept (measured and removed): the batch-1 router's top-k by rank (a [E, E] compare of the int64 keys and two
# selects) instead of TOP_K rounds of max: batch 1 -1.8% (H100, 2026-12-06, switchab; norm_moe T=1 alone 24.7 ->
# 26.6 µs).


# The batch-1 MoE's two expert stages in one launch (fused_moe/slices.py): a program owns a slice of one expert's
# intermediate rows, computes their gate/up over the whole input, silu and the product in registers, and adds
# that slice's share of the down projection to the output with fp32 atomics. No gu buffer and no launch boundary
# between gate/up and down (stages.py's two launches, the second waiting for the whole first). Costs: fewer,
# longer programs (192 at the served shape against ~1,000 per stage), the down's scales read once per slice, H
# atomics per program. int4 GPTQ without act order (slices.supported); any compute capability (no tl.dot, no
# PDL needed). ON from 2026-12-07 (H100, bench/run_h200.sh decode10, one engine, alternating; BENCHMARKS.md):
# batch 1 at 512 tokens 444.6 -> 454.2 tok/s, at 32k 301.5 -> 306.1, batch 16 unchanged, the same greedy tokens
# (norm_moe T=1 alone 24.7 -> 24.5 µs; BLOCK_I 16, slices16, lost: 442.9). ``set_switch("batch1_moe_slices",
# False)`` turns it off in a process.
BATCH1_MOE_SLICES = _switch("batch1_moe_slices", True)


def batch1_moe_slices() -> bool:
    """Does the batch-1 MoE block run its expert stages as one launch of intermediate slices (where supported)?"""
    return switch("batch1_moe_slices")


# With BATCH1_MOE_SLICES: every slices program finds the token's top-k itself from the router's logits (softmax and
# TOP_K rounds of max, fused_moe/decode.topk_of, the same keys and ties) and the norm-route launch ends when its
# programs have stored their logits: no arrival counter (an acq_rel atomic and the barrier before it), no last
# program's top-k and routing stores at the end of that launch, no routing load at the start of the slices'.
# The top-k is then computed 192 times (on 8 warps) instead of once (on 4). ON from 2026-12-07 (H100, decode10):
# with the slices, batch 1 at 512 tokens 454.2 -> 457.3 tok/s, at 32k 306.1 -> 307.8 (444.6 and 301.5 without
# either), the same greedy tokens; norm_moe T=1 alone 24.5 -> 23.5 µs. Then measured inside the model
# (bench/slices_trace.py): the routing took ~2.8 µs of each program's ~13-16, before its first weight load; with
# each warp routing its own copy of the logits (decode.topk_slot_of: no CTA barrier in the rounds of max) batch 1
# at 512 tokens went 458.7 / 458.9 -> 472.4 / 471.9 tok/s (ab, one process per arm and run, H100).
BATCH1_SLICES_ROUTE = _switch("batch1_slices_route", True)


def batch1_slices_route() -> bool:
    """Do the batch-1 MoE slices (when they run) route the token themselves from the router's logits?"""
    return switch("batch1_slices_route")


# The batch-1 MoE slices' gate/up dot in packed fp16 (fused_moe/slices.py HALF2, gptq_gemm/int4.half2_dot8): a word's
# 8 nibbles become four f16x2 pairs of exact n - z (a shift, a lop3 and a sub.f16x2 a pair) multiplied and added
# with the inputs in pairs, four products a half in fp16, the halves and the group's scale in fp32. Why: the
# loop is bound by instructions where two programs share an SM (sm90 SASS of the shipped loop: 712 instructions
# for a thread's 128 weights a step, ~5.6 a weight, the issue slots of two programs ~ the phase's measured time);
# this takes it to ~2.4 a weight plus the loads. The products are rounded to fp16 (4 to a sum) where the shipped
# loop rounds nothing but fp32 sums. ON from 2026-12-07 (H100, bench/run_h200.sh decode15, one engine, alternating,
# medians of 3; BENCHMARKS.md): batch 1 at 512 tokens 484.2 -> 506.5 tok/s (+4.6%), at 32k 320.8 -> 330.3, the same
# greedy tokens; under ONECARD_EMULATE_CC=70 (the pre-Ampere loop, with the GEMV's below) 440.5 -> 463.9; full-size
# logits vs the reference backend rel. err 4.1e-4, argmax 1.00. The same dot in the dense batch-1 GEMV (qkv, o_proj;
# its loop 390 -> 265 instructions a tile) lost in the same A/B (484.2 -> 479.6 alone, 506.5 -> 501.6 beside this
# one: the GEMV holds its tiles before the PDL wait, and fewer instructions after it did not shorten the chain):
# not kept (BENCHMARKS.md, 2026-12-07 16:15).
BATCH1_SLICES_HALF2 = _switch("batch1_slices_half2", True)


def batch1_slices_half2() -> bool:
    """Do the batch-1 MoE slices (fp16) multiply their gate/up tiles in packed fp16?"""
    return switch("batch1_slices_half2")


# The batch-1 MoE layer without its norm-route launch (fused_moe/router_fold.py): the router's logits are linear in
# the post-attention norm's input up to one scalar, logits = rstd * (gate * nw) @ (residual + W_o a), so the o_proj
# GEMV's programs add each split's share of them into a zeroed fp32 row (M = (gate * nw) @ W_o^T and F = gate * nw,
# built once per layer: 1.5 MB fp16 at the served shape, 72 MB over 48 layers), and each MoE slices program normalises
# the row itself (rstd, the normalised input into a row of its own, the new residual a share each) and routes from
# rstd * those sums. One dependent launch fewer a layer (the norm-route's ~2.1 µs in the H100 profile of
# 2026-12-07) for a little more work in o_proj (sm90: 96 -> 128 registers, still 4 programs an SM) and in the
# slices' prologue. Needs the accumulating attention block (BATCH1_ACCUMULATE) and the slices routing themselves
# (BATCH1_MOE_SLICES, BATCH1_SLICES_ROUTE). ON from 2026-12-07 (H100, bench/run_h200.sh fold: one engine,
# alternating, medians of 3): batch 1 at 512 tokens 473.1 -> 480.5 tok/s, at 32k 315.2 -> 317.0, the same greedy
# tokens; full_size (two runs each, either order) 475.3 / 474.7 -> 480.3 / 480.3, batch 16, prefill and TTFT
# within their spread, full-size logits rel. err 4e-4, argmax 1.00. ``set_switch("batch1_router_fold", False)``
# turns it off in a process (the runner then builds no folds).
BATCH1_ROUTER_FOLD = _switch("batch1_router_fold", True)


def batch1_router_fold(tokens: int) -> bool:
    """Does a ``tokens``-token MoE layer fold its router into o_proj and its norm into the slices?"""
    return (tokens == 1 and switch("batch1_router_fold") and batch1_accumulate(tokens) and batch1_moe_slices()
            and batch1_slices_route())


# Batch-1 decode reading the next layer's KV into L2 while this layer's MoE runs (layers/kv_prefetch.py,
# attention/triton.kv_touch on a side stream: forked after a layer's attention block, joined at the end of the
# forward, so the main chain gains no dependency). Why: at long contexts the attention is bound by its KV bytes
# (32k: 67 MB a layer at ~98% of the copy rate, BENCHMARKS.md) while the rest of a layer is bound by latency and
# leaves the HBM mostly idle; the first KV_PREFETCH_MB of a layer's KV (positions from 0; evict_last loads) can
# then come from the 50 MB L2. Costs: a layer's MoE shares the bandwidth with the reads, and up to
# KV_PREFETCH_MB / 2 KB positions x 2 KB of reads a layer at every context (a short one reads what it has).
# Model-dtype caches, CUDA, the Triton backend. OFF: not measured yet (bench/kv_l2_probe.py, then the A/B in
# bench/run_h200.sh kvpf). ``set_switch("batch1_kv_prefetch", True)`` turns it on in a process.
BATCH1_KV_PREFETCH = _switch("batch1_kv_prefetch", False)
KV_PREFETCH_MB = 24                   # KV bytes read into L2 ahead of a layer's attention (its first positions)
KV_PREFETCH_CHUNK = 16                # positions a program of the read (kv_touch's sums, one per chunk)


def batch1_kv_prefetch(tokens: int) -> bool:
    """Does a ``tokens``-token decode step read each next layer's KV into L2 during this layer's MoE (batch 1)?"""
    return tokens == 1 and switch("batch1_kv_prefetch")


def kv_prefetch_positions(kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Positions of a layer's KV (K and V rows of every KV head) that KV_PREFETCH_MB holds, whole chunks."""
    per = 2 * kv_heads * head_dim * elem_bytes
    return max(KV_PREFETCH_CHUNK, KV_PREFETCH_MB * 2**20 // per // KV_PREFETCH_CHUNK * KV_PREFETCH_CHUNK)


# Decode MoE at T > 1: silu(gate) * up as a launch of its own between the two stages, stage 2 then loading it as
# stage 1 loads x. Without it every stage-2 program recomputes silu for its K tile (exp and a division per value,
# each value once per column tile of the down projection: 16 times at the served shape). Identical values either
# way (the same fp32 formula, rounded to the model dtype before the dot). Measured alone (H100, 2026-12-06,
# switchab): batch 16 at 512 tokens 2,614 -> 2,906 tok/s. Left off as a switch of its own: DECODE_INT_DOT (on)
# implies it where it applies and gains more (3,134); it still matters where the int dot does not (bf16, g_idx,
# below sm80).
DECODE_MOE_ACT_LAUNCH = _switch("decode_moe_act_launch", False)


def decode_moe_act_launch(tokens: int) -> bool:
    """Does a decode MoE of ``tokens`` tokens compute silu(gate) * up in a launch of its own (T > 1 only)?"""
    return tokens > 1 and switch("decode_moe_act_launch")


# The decode GEMMs at 1 < T <= 16 in fp16 (the dense skinny GEMM and both decode MoE stages, int4 weights with one
# group per K tile): the exact-integer dot, int4.int_dot_tile. The weights enter tl.dot as their exact n - z (a
# byte permute, two and-ors and two packed subtracts per four weights) and the group's scale multiplies each K
# tile's fp32 sum once, instead of a shift, an and-or, a pack, a subtract and a multiply per weight; the MoE's
# stage 2 then loads the silu launch's rows. sm90 SASS per loop: MoE stage 1 1,255 -> 834 instructions, stage 2
# 1,254 -> 818; these loops are bound by instructions (the MoE's time did not move with 4-24 programs per SM).
# ON from 2026-12-06 (H100, bench/run_h200.sh switchab, one engine, alternating; BENCHMARKS.md): batch 16 at 512
# tokens 2,614 -> 3,134 tok/s (+20%), 16 x 8k 1,555 -> 1,735; graph µs fused MoE T=16 166 -> 149, o_proj M=16
# 10.0 -> 9.0 (qkv 11.4 -> 11.8); batch 1 unchanged. set_switch("decode_int_dot", False) turns it off in a process.
DECODE_INT_DOT = _switch("decode_int_dot", True)


# Not at batch 1 (measured and removed): the dense GEMV and the decode MoE's gate/up stage as a tensor-core dot on
# 16 input rows, 15 of them masked (sm90 SASS per loop: GEMV 6.1 -> 3.45 instructions per weight, MoE stage 1 693
# -> 453) lost (H100, 2026-12-06, switchab): graph µs qkv M=1 5.5 -> 8.0, o_proj 4.2 -> 6.0, fused MoE T=1 19.9 ->
# 23.7; batch 1 at 512 tokens 418.8 -> 354.8 tok/s: a GEMV whose programs each stream 1-3 tiles at 2 warps is bound
# by latency, not issue. (With it on, the g128 coder's batch-1 greedy text from CUDA graphs differed from eager in
# 2 of 3 runs, bench/gpu_checks.py; never looked into.) The batch-1 MoE slices' dots run in packed fp16 instead
# (BATCH1_SLICES_HALF2).


def int_dot(tokens: int, cc: int) -> bool:
    """Do the decode GEMMs of a ``tokens``-token step take the exact-integer dot where their weights allow? 2..
    DECODE_MAX_TOKENS tokens: DECODE_INT_DOT; batch 1 never. Only with tensor-core dots (sm80+): below, tl.dot is
    FMA code and the transposed, interleaved operands cost more than the dequantize step saves (sm70 SASS of the
    skinny loop: 3,123 -> 3,918 instructions)."""
    return 2 <= tokens <= DECODE_MAX_TOKENS and tensor_core_dot(cc) and switch("decode_int_dot")


# The decode MoE below sm80 at 1 < T <= DECODE_MAX_TOKENS (fused_moe/stages.py, ROWS): tl.dot is FMA code there
# and multiplies its whole 16-row token block, so every weight of an expert costs 16 FMAs however few tokens
# chose it (at batch 16 an expert has 128 / 82 ~ 1.6 tokens on average: the padded dot is ~10x the real work;
# sm70 SASS of stage 1's K loop: 3,118 instructions for 128 weights a thread). Instead a program compacts the
# tokens routed to its expert and takes them DECODE_ROWS_PRE_AMPERE at a time, each pass the GEMV's tile step on
# that many rows (the nibbles decoded once for all of them, a shift and a LOP3 a weight, then an FMA a row; the
# scale and zero once per tile): one pass for ~88% of experts at batch 16 under uniform routing, a pass per 2
# tokens where many share one. sm70 SASS of the K loop a pass: 1,007 instructions for 128 weights a thread
# (bench/v100_estimate.py's pipe model: 233 µs a layer at batch 16 against 926 for the dot, whose 202 MB take
# 269 µs at 750 GB/s). Not timed on a V100 (none here): decided by that count (tests/kernels/test_aot.py,
# bench/sass_report.py). ONECARD_EMULATE_CC=70 runs it on a newer card as a functional check only: sm80+ compiles
# the dot it replaces to tensor cores (sm90 SASS: 697 instructions against the row step's 1,337), so an emulated
# A/B there measures the wrong card. set_switch("pre_ampere_decode_rows", False) gives back the 16-row dot.
DECODE_ROWS_PRE_AMPERE = 2
PRE_AMPERE_DECODE_ROWS = _switch("pre_ampere_decode_rows", True)


def decode_rows(tokens: int, cc: int) -> int:
    """Token rows per pass of the decode MoE's compacted row step for a ``tokens``-token step (0: the dot)."""
    if 1 < tokens <= DECODE_MAX_TOKENS and not tensor_core_dot(cc) and switch("pre_ampere_decode_rows"):
        return DECODE_ROWS_PRE_AMPERE
    return 0


# The same step for the dense skinny GEMM below sm80 (gptq_gemm/small_m.py ROWS: qkv, o_proj at 2..16 tokens),
# whose 16-row FMA dot costs the same at M = 2 as at 16: there every row is real, so the passes grow with M
# (ceil(M / 2)) and the step wins only while they stay few. sm70 cycles a warp and 16K-weight tile (the pipe
# model of bench/v100_estimate.py): the dot 4,660 at any M, a pass 1,076 (the MoE's step; its SASS is
# the same loop); up to DENSE_ROWS_MAX_M rows (3 passes: 3,228) it takes the step, above it the dot (4 passes at
# M = 7, 8: 4,304, ~8% less compute for 4 reads of the weights). The same switch.
DENSE_ROWS_MAX_M = 6


def dense_rows(m: int, cc: int) -> int:
    """Rows per pass of the dense skinny GEMM's row step for ``m`` rows (0: the dot)."""
    return decode_rows(m, cc) if m <= DENSE_ROWS_MAX_M else 0


# Not kept (measured and removed): the decode MoE's silu with libdevice's fast exp and division (6 instructions a
# value instead of 13; sm90 SASS of the down stage's K loop at batch 1 1,112 -> 934): alone it won (H100,
# 2026-12-06, switchab: batch 1 at 512 tokens 418.8 -> 427.9 tok/s), but with the decode configs shipped the same
# day it lost (419.1 -> 416.0); at batch 16 DECODE_INT_DOT's silu launch replaces the inline silu it sped up.


def triton_moe_config(tokens: int, cc: int) -> str:
    """The Triton fused MoE's config for T tokens: a decode config, sorted16 or sorted64 (sorted64's gated
    GEMM spills below sm80: 704 B of stack per thread on sm70; sorted16 serves there up to the per-expert path)."""
    if tokens <= DECODE_MAX_TOKENS:
        return choose_decode_moe(max(tokens, 1), cc)
    return "sorted16" if (tokens <= SORTED16_MAX_TOKENS or not tensor_core_dot(cc)) else "sorted64"


def per_expert_moe(cc: int) -> bool:
    """The prefill MoE below sm80: one cuBLAS GEMM per expert (PyTorch's grouped GEMM is not built there)."""
    return not tensor_core_dot(cc)


def grouped_gemm_dtype(act: str, cc: int, supported: Iterable[str]) -> str | None:
    """The dtype the grouped GEMM runs in for activations ``act`` ("float16" ...), given the dtypes the
    start-up probe found working (``supported``); None: no grouped GEMM. fp16 runs as bf16 on sm90+: PyTorch's
    fast grouped GEMM takes bf16 only, and its fp16 fallback (a host sync and one cuBLAS call per group) was
    ~36% of a 4,096-token prefill on the H200. Where the preferred dtype does not work, bf16 does the job."""
    ok = set(supported)
    preferred = "bfloat16" if (act == "float16" and cc >= GROUPED_BF16_MIN_CC) else act
    for d in (preferred, "bfloat16"):
        if d in ok:
            return d
    return None


def choose_moe(tokens: int, cc: int, gpu: bool = True, act: str = "float16",
               grouped_dtypes: Iterable[str] = ("float16", "bfloat16", "float32")) -> str:
    """Fused MoE path for T tokens. ``grouped_dtypes``: what PyTorch's grouped GEMM runs here (start-up probe)."""
    if gpu and tokens >= GROUPED_MIN_TOKENS:
        if per_expert_moe(cc):
            return "per-expert"
        if grouped_gemm_dtype(act, cc, grouped_dtypes) is not None:
            return "grouped"
    return triton_moe_config(tokens, cc)


def choose(op: str, tokens: int, cc: int, **kw: Any) -> str:
    """The path of ``op`` (one of OPS) for ``tokens`` rows on capability ``cc``."""
    if op == "dense_gemm":
        return choose_dense_gemm(tokens, cc, **kw)
    if op == "moe":
        return choose_moe(tokens, cc, **kw)
    raise ValueError(f"unknown op {op!r}; one of {OPS}")


def attention_tiles(cc: int, block_m: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of paged attention for a program of block_m = BLOCK_Q * GROUP_PAD query rows.

    sm80+: tensor-core tl.dot, 64-key tiles on 4 warps. Below sm80 tl.dot is FMA code that keeps its operand
    tiles in registers, and those tiles spill: at the served shape (D 128, JIT-aligned sm70 compile) 432 B of
    stack per thread for decode (16 rows) and 13,032 B for prefill (64 rows). The tiles used there are the
    largest found that compile with no spill on 8 warps (decode 32 keys: 210 registers; prefill 16 keys: 239);
    tests/kernels/test_aot.py checks the no-spill part. Not timed on a V100 (none available)."""
    if tensor_core_dot(cc):
        return ATTN_BLOCK_N, ATTN_WARPS
    return (32, 8) if block_m <= 16 else (16, 8)


# Prefill attention below sm80 on PyTorch's SDPA (attention/sdpa.py): there tl.dot is FMA code, and a chunk of n
# new tokens over L positions is 4 n L Hq D FLOPs a layer against 4 L Hkv D bytes of KV, 8 n FLOPs a byte at the
# served shape: compute-bound from n ~ 3 on a V100 (15.7 TFLOP/s FMA / ~750 GB/s = 21 FLOPs a byte). A 4,096-token
# prompt's attention is 137 GFLOP a layer, ~8.8 ms at the FMA rate, half of that prefill (bench/v100_estimate.py);
# the memory-efficient SDPA kernel runs it on tensor cores. A sequence with more than SPLIT_MAX_QUERY new tokens in
# an eager step takes it; shorter ones (decodes, speculative verify rows, a prompt's last few tokens) stay on the
# Triton kernel, whose split-KV spreads their keys over every SM (SDPA's grid is heads x 64-query blocks: 32
# programs for a short chunk) and which the CUDA graphs capture. Not timed on a V100 (none here): the arithmetic
# above decided it; ONECARD_EMULATE_CC=70 runs it on a newer card (tests/gpu). set_switch("prefill_sdpa", False)
# keeps every sequence on the Triton kernel.
PREFILL_SDPA = _switch("prefill_sdpa", True)


def prefill_sdpa(query_len: int, cc: int) -> bool:
    """Does a sequence with ``query_len`` new tokens in an eager step take SDPA's attention (capability ``cc``)?"""
    return query_len > SPLIT_MAX_QUERY and not tensor_core_dot(cc) and switch("prefill_sdpa")


def prefill_sdpa_on(cc: int) -> bool:
    """Does capability ``cc`` send any prefill chunk to SDPA (the start-up probe, the memory reserve, the plan)?"""
    return prefill_sdpa(SPLIT_MAX_QUERY + 1, cc)


def prefill_sdpa_workspace(max_seq_len: int, max_query_len: int, q_heads: int, kv_heads: int, head_dim: int,
                           elem_bytes: int, cache_elem_bytes: int) -> int:
    """Bytes the SDPA path holds at once beyond its launch's output, at most (the runner's memory profile reserves
    them, ``onecard plan`` counts them): one sequence's gathered K and V (in the cache's element size, and in the
    model's too where they differ: the fp8 conversion) and two copies of its chunk's output (SDPA's, then the one
    put back in token order)."""
    kv = 2 * max_seq_len * kv_heads * head_dim * (elem_bytes + (cache_elem_bytes if cache_elem_bytes != elem_bytes
                                                                else 0))
    return kv + 2 * max_query_len * q_heads * head_dim * elem_bytes


# The knobs of a decode-only attention launch that ``set_decode_attention_override`` may replace (benchmarks,
# tests; bench/attn_sweep.py sweeps them): DecodeAttention's fields.
DECODE_ATTN_KNOBS = ("segments", "min_seg_tiles", "block_n", "num_warps", "num_stages", "reduce_block_s",
                     "reduce_warps", "prefetch", "reduce_d_split")


class _SplitKvPolicy:
    """Set by ``set_split_kv_policy`` / ``set_decode_attention_override`` (tests, benches); unset: the policy is
    read once from env.Env (ONECARD_SPLIT_KV) and every knob takes the table's value. Serving never sets it."""

    name: str | None = None
    ctas_per_sm: int | None = None
    override: ClassVar[dict[str, Any]] = {}


def set_split_kv_policy(name: str | None, ctas_per_sm: int | None = None) -> None:
    """Use split-KV policy ``name`` (one of SPLIT_KV_POLICIES; None: the environment's) in this process;
    ``ctas_per_sm`` overrides SPLIT_CTAS_PER_SM for "fill" (benchmark sweeps). Launches decide at launch time:
    CUDA graphs keep the choice they were captured with."""
    if name is not None and name not in SPLIT_KV_POLICIES:
        raise ValueError(f"split-KV policy {name!r} is not one of {SPLIT_KV_POLICIES}")
    _SplitKvPolicy.name, _SplitKvPolicy.ctas_per_sm = name, ctas_per_sm


def small_q_split() -> bool:
    """Whether launches of at most SPLIT_MAX_QUERY query rows per sequence (not decode-only) are split."""
    return switch("small_q_split")


def splits_small_q(max_query_len: int) -> bool:
    """Does a launch that is not decode-only, whose longest sequence has ``max_query_len`` query rows, split its
    KV (a speculative verify step)? The rule attention_launch applies and the spec cost model prices."""
    return max_query_len <= SPLIT_MAX_QUERY and small_q_split()


def set_decode_attention_override(**knobs: Any) -> None:
    """Replace knobs (DECODE_ATTN_KNOBS) of every decode-only attention launch in this process, for benchmark
    sweeps and tests only; no argument (or all None): back to the table. ``segments`` forces the split (1: none);
    ``block_n`` also sets the tile count the split policy counts in; ``prefetch`` turns on the kernel's own
    prefetch (1: the next key tile's block-table entries; 2: also its K/V; off by default: unmeasured). Launches decide at launch time: CUDA graphs keep the
    config they were captured with."""
    bad = sorted(set(knobs) - set(DECODE_ATTN_KNOBS))
    if bad:
        raise ValueError(f"unknown decode-attention knobs {bad}; known: {DECODE_ATTN_KNOBS}")
    _SplitKvPolicy.override = {k: v for k, v in knobs.items() if v is not None}


def decode_attention_override() -> dict[str, Any]:
    """The knobs ``set_decode_attention_override`` set now (a copy; empty when serving)."""
    return dict(_SplitKvPolicy.override)


@functools.lru_cache(maxsize=1)
def _env_split_kv() -> str:
    from onecard.env import Env  # the one reader of the environment

    return Env.read().split_kv


def split_kv_policy() -> str:
    return _SplitKvPolicy.name or _env_split_kv()


def split_kv_ctas_per_sm(cc: int) -> int:
    """Decode-attention CTAs per SM that one wave of split-KV programs holds on capability ``cc``."""
    if _SplitKvPolicy.ctas_per_sm is not None:
        return _SplitKvPolicy.ctas_per_sm
    return SPLIT_CTAS_PER_SM if tensor_core_dot(cc) else SPLIT_CTAS_PER_SM_PRE_AMPERE


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_kv(num_seqs: int, decode_only: bool, max_seq_len: int, kv_heads: int, sms: int, cc: int,
             policy: str | None = None, query_blocks: int = 0, block_n: int | None = None) -> tuple[int, int]:
    """(segments, shortest segment in key tiles) of a paged-attention launch; (1, 1): no split.
    ``query_blocks`` > 0: a small-q launch (not decode-only; attention_launch decides which) with that many query
    blocks per sequence, split like a decode launch of num_seqs x query_blocks sequences (each q-block program
    cuts its own key range, up to its last row's position, into the segments); ``block_n``: its key tile
    (default: the decode tile of ``cc``).

    ``max_seq_len`` is an upper bound on every sequence's length (CUDA graphs pass max_model_len): the kernel
    splits each sequence's own key tiles into ceil(tiles / segments)-tile segments (never shorter than the
    returned minimum), so a segment is a whole number of BLOCK_N-key tiles, shorter contexts leave the last
    segments empty (their programs exit at once, the reduce reads only the filled ones) and the count depends
    only on the launch's shapes (B, KV heads, the bound): a captured graph stays right for every context.

    Policy "fill" (the default): the count with the shortest critical path, counted in key tiles: the resident
    programs (one wave = ``split_kv_ctas_per_sm(cc)`` x ``sms``) run together, so B x KV heads x S programs take
    ceil(programs / wave) waves of ceil(tiles / S) + SPLIT_PROGRAM_OVERHEAD_TILES each (the overhead: loading q,
    writing the partials, which the reduce reads back); the fewest segments among equals, at most MAX_SEGMENTS
    and one per SPLIT_MIN_SEGMENT_TILES tiles of the bound. This fills the SMs while B x KV heads do not
    (bs1 at 32k on 132 SMs: 86 segments of 6 tiles), splits no batch that already fills a wave evenly, and
    bounds the reduce: its partials (B x query heads x S rows of D fp32) are at most one wave of programs x
    GROUP rows at a short bound, and at long contexts a segment is many tiles long.
    Policy "legacy" (issue 25's before, for A/B): ~2 programs per SM rounded up to a power of two, at most
    LEGACY_MAX_SEGMENTS (bs1 at 32k on 132 SMs: 16 segments, 64 programs: half the SMs idle).
    Below SPLIT_MIN_SEQ_LEN nothing splits."""
    small_q = query_blocks > 0 and not decode_only
    ov = _SplitKvPolicy.override if decode_only else {}
    if "segments" in ov:                                                  # a bench/test's forced split
        return max(1, int(ov["segments"])), int(ov.get("min_seg_tiles", SPLIT_MIN_SEGMENT_TILES))
    policy = policy or split_kv_policy()
    if not (decode_only or small_q) or max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1, 1
    base = max(1, num_seqs * kv_heads * (query_blocks if small_q else 1))   # programs without a split
    if policy == "legacy":
        want = 2 * sms // base
        return max(1, min(LEGACY_MAX_SEGMENTS, 1 if want <= 1 else 1 << (int(want) - 1).bit_length())), 1
    tiles = _cdiv(max_seq_len, ov.get("block_n") or block_n or attention_tiles(cc, 16)[0])   # tiles of the bound
    return _fill_segments(base, tiles, split_kv_ctas_per_sm(cc) * sms), SPLIT_MIN_SEGMENT_TILES


@functools.lru_cache(maxsize=4096)
def _fill_segments(base: int, tiles: int, wave: int) -> int:
    """split_kv's "fill" count for ``base`` programs per segment, ``tiles`` key tiles, ``wave`` resident programs."""
    most = max(1, min(MAX_SEGMENTS, tiles // SPLIT_MIN_SEGMENT_TILES))
    return min(range(1, most + 1),
               key=lambda s: (_cdiv(base * s, wave) * (_cdiv(tiles, s) + SPLIT_PROGRAM_OVERHEAD_TILES), s))


def split_kv_segments(num_seqs: int, decode_only: bool, max_seq_len: int, kv_heads: int, sms: int,
                      cc: int = 90) -> int:
    """The segment count of ``split_kv``."""
    return split_kv(num_seqs, decode_only, max_seq_len, kv_heads, sms, cc)[0]


class AttentionLaunch(NamedTuple):
    """One paged-attention launch: the kernel's tiles and split, and the split-KV reduce's config."""

    segments: int            # split-KV segments per (sequence, KV head); 1: no split, no reduce
    min_seg_tiles: int       # the shortest segment, in key tiles
    block_n: int             # keys per tile
    num_warps: int
    num_stages: int          # Triton's software pipelining (sm80+: how many key tiles cp.async runs ahead - 1)
    reduce_block_s: int      # segments the reduce merges per step
    reduce_warps: int
    prefetch: int            # 0: none; 1: the next tile's block-table entries; 2: also its K/V, in registers
    row_reduce: bool = False  # split, not decode-only: the row-wise reduce (any query rows per sequence)
    reduce_d_split: int = 1   # the decode reduce's programs per head (each 1/reduce_d_split of D)


def attention_launch(num_seqs: int, decode_only: bool, max_seq_len: int, kv_heads: int, sms: int, cc: int,
                     block_m: int, max_query_len: int = 1, query_blocks: int = 1) -> AttentionLaunch:
    """The launch of paged attention for programs of ``block_m`` query rows (split_kv's arguments otherwise):
    the table's tiles (attention_tiles, ATTN_STAGES), the split (split_kv) and the reduce (REDUCE_BLOCK_S,
    REDUCE_WARPS); for a decode-only launch, the knobs ``set_decode_attention_override`` set replace these.
    A launch that is not decode-only splits only while ``small_q_split()`` and ``max_query_len`` (the longest
    sequence's query rows; ``query_blocks`` per sequence) is at most SPLIT_MAX_QUERY: host-known shapes only,
    so a captured verify graph keeps its split for every context. Such a launch's reduce is row-wise."""
    block_n, warps = attention_tiles(cc, block_m)
    small_q = not decode_only and splits_small_q(max_query_len)
    segs, min_tiles = split_kv(num_seqs, decode_only, max_seq_len, kv_heads, sms, cc,
                               query_blocks=max(1, query_blocks) if small_q else 0,
                               block_n=block_n if small_q else None)
    ov = _SplitKvPolicy.override if decode_only else {}
    bs = min(next_pow2(segs), ov.get("reduce_block_s", REDUCE_BLOCK_S))
    prefetch = int(ov.get("prefetch", ATTN_PREFETCH))
    row_reduce = segs > 1 and not decode_only
    return AttentionLaunch(segs, min_tiles, ov.get("block_n", block_n), ov.get("num_warps", warps),
                           ov.get("num_stages", ATTN_STAGES), bs,
                           ov.get("reduce_warps", REDUCE_WARPS if row_reduce else DECODE_REDUCE_WARPS),
                           prefetch, row_reduce, ov.get("reduce_d_split", REDUCE_D_SPLIT) if decode_only else 1)


def use_pdl(num_tokens: int, cc: int, max_tokens: int) -> bool:
    """Programmatic dependent launch for a ``num_tokens``-token launch (on a real GPU): sm90+, and at most
    ``max_tokens`` tokens (ONECARD_PDL_MAX_TOKENS; measured slower at batch 16, so the default is 1)."""
    return 0 < num_tokens <= max_tokens and cc >= PDL_MIN_CC


# ---------------------------------------------------------------- what reads the table
def token_boundaries(limit: int = 4 * GROUPED_MIN_TOKENS, caps: Iterable[int] = CAPABILITIES) -> list[int]:
    """Every token count T at which some op's path differs from its path at T - 1, on some capability
    (GPU, every grouped dtype available). The precompile's dry shapes include T - 1 and T for each."""
    out: set[int] = set()
    for cc in caps:
        for op in OPS:
            prev = choose(op, 1, cc)
            for t in range(2, limit + 1):
                cur = choose(op, t, cc)
                if cur != prev:
                    out.add(t)
                prev = cur
    return sorted(out)


def describe(cc: int | None, quantized: bool) -> dict[str, str]:
    """The probe's one-line description of each op's kernels on capability ``cc`` (None: CPU)."""
    if cc is None:
        ref = "reference PyTorch (CPU mode: no GPU kernels)"
        return {"attention": ref, "dense_gemm": ref, "moe": ref, "sampling": "PyTorch on CPU (fp32 logits)"}
    sampling = "PyTorch on the GPU (fp32 logits, top-k/top-p/min-p on device)"
    tc = tensor_core_dot(cc)
    dot = "tl.dot tensor cores" if tc else "tl.dot runs as FMA on sm70/75"
    pdl = f"; PDL for launches of <= 1 token by default (sm{PDL_MIN_CC}+)" if cc >= PDL_MIN_CC else ""
    if not quantized:
        dense = "cuBLAS torch.matmul" + ("" if tc else " (tensor cores via cuBLAS; tl.dot has none before sm80)")
    elif tc:
        dense = (f"triton w4a16 GEMM (tl.dot tensor cores) up to {DENSE_CUBLAS_MIN_M - 1} rows; "
                 f"prefill (>= {DENSE_CUBLAS_MIN_M} tokens): dequantize + cuBLAS")
    else:
        dense = (f"prefill (>= {CUBLAS_MIN_M_PRE_AMPERE} tokens): dequantize + cuBLAS (tl.dot has no tensor "
                 f"cores before sm80); decode: triton w4a16 GEMV (memory-bound), two rows a program up to "
                 f"{DENSE_ROWS_MAX_M} rows")
    if per_expert_moe(cc):
        moe = (f"prefill (>= {GROUPED_MIN_TOKENS} tokens): dequantize + one cuBLAS GEMM per expert; "
               f"smaller batches: triton fused MoE (FMA on sm70/75; decode: each expert's tokens two a pass)")
    else:
        gd = "bf16" if cc >= GROUPED_BF16_MIN_CC else "the serving dtype"
        moe = (f"prefill (>= {GROUPED_MIN_TOKENS} tokens): dequantize + PyTorch grouped GEMM in {gd}; "
               f"smaller batches: triton fused MoE (tl.dot tensor cores)")
    attention = f"triton paged attention ({dot}){pdl}"
    if prefill_sdpa_on(cc):
        attention += (f"; prefill chunks of > {SPLIT_MAX_QUERY} tokens: PyTorch SDPA, memory-efficient kernel "
                      "(tensor cores)")
    return {"attention": attention, "dense_gemm": dense, "moe": moe,
            "sampling": sampling}


__all__ = [
    "CAPABILITIES",
    "DECODE_ATTN_KNOBS",
    "OPS",
    "AttentionLaunch",
    "as_int",
    "attention_launch",
    "attention_tiles",
    "bf16_allowed",
    "capability",
    "choose",
    "choose_decode_moe",
    "choose_dense_gemm",
    "choose_moe",
    "decode_attention_override",
    "decode_moe_act_launch",
    "decode_rows",
    "dense_cublas_min_m",
    "dense_rows",
    "describe",
    "device_props",
    "emulated_capability",
    "grouped_gemm_dtype",
    "int_dot",
    "next_pow2",
    "per_expert_moe",
    "prefill_sdpa",
    "prefill_sdpa_on",
    "prefill_sdpa_workspace",
    "real_capability",
    "set_decode_attention_override",
    "set_emulated_capability",
    "set_split_kv_policy",
    "set_switch",
    "small_q_split",
    "split_kv",
    "split_kv_ctas_per_sm",
    "split_kv_policy",
    "split_kv_segments",
    "splits_small_q",
    "switch",
    "switches",
    "tensor_core_dot",
    "token_boundaries",
    "triton_gemm_config",
    "triton_moe_config",
    "use_pdl",
]
