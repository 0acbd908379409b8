"""Shared helpers for the Triton backends: device facts (cached, host-side only: no GPU syncs) and the
AOT config record every ``triton.py`` exports through ``aot_configs()``.

``AotConfig`` = one kernel at one block configuration and signature that a dispatcher can launch; the AOT
test compiles each for sm70/75/80/90 with ``triton.compile(ASTSource(...), target=GPUTarget(...))``.

Programmatic dependent launch (PDL, sm90+): the decode-path kernels take a ``PDL`` constexpr and are launched
with ``launch_pdl=PDL`` (``pdl(device, num_tokens)`` decides). Such a kernel's programs start while the
previous kernel in the stream is still running and stop at ``pdl_enter`` until it has finished and its
writes are visible, so a launch's start-up and its first weight loads overlap the previous kernel's tail
(each decode layer is ~12 small kernels: their ramps were a large part of the batch-1 step).
Transitivity: every program calls ``pdl_enter`` unconditionally (before any early return), and it lets the
next launch start only after its own wait, so when a kernel's programs start, every kernel before the
previous one is complete; when it passes its wait, all are. Hence the rule for code before ``pdl_enter``:
write nothing; read weights, or outputs of a launch at least two back in the same PDL chain (from L2,
``cache_modifier=".cg"``: an SM's L1 may hold a stale line of a reused buffer), never the previous launch's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from onecard.kernels import paths
from onecard.kernels.paths import next_pow2  # noqa: F401  (re-exported: the kernels' import site)

TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
            torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8"}


@dataclass(slots=True)
class AotConfig:
    kernel: Any                       # a @triton.jit function
    signature: dict[str, str]         # arg name -> "*fp16" | "i32" | "fp32" | "constexpr"
    constexprs: dict[str, Any]        # constexpr name -> value
    num_warps: int = 4
    num_stages: int = 2
    min_cc: int = 70                  # skip for targets below this compute capability (e.g. bf16 paths)
    name: str = field(default="")


def signature(arg_types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Complete a signature: every constexpr argument gets the type string "constexpr"."""
    sig = dict(arg_types)
    for k in constexprs:
        sig[k] = "constexpr"
    return sig


def interpreting() -> bool:
    # The only os.environ read in the kernels: Triton itself keys off this variable.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# May device code use what only the GPU compiler takes (inline PTX, libdevice)? Not under the interpreter, which
# runs neither: there the helpers that use them (gptq_gemm/int4.byte_pair_diffs, half2_dot8) compute the same
# values with Triton ops. Fixed for the process, as the interpreter is (Triton reads the
# variable at import).
NATIVE = tl.constexpr(not interpreting())


def compute_capability(device: torch.device) -> int:
    """Like 80 for sm80: kernels/paths.capability, the one capability question (ONECARD_EMULATE_CC honoured;
    the interpreter on the CPU counts as 80 so it exercises the tensor-core paths)."""
    return paths.capability(device)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4                      # small, so split-K paths run under the interpreter too
    return paths.device_props(device.index if device.index is not None else torch.cuda.current_device())[1]


class _Pdl:
    """The process-wide PDL setting: launches of at most ``max_tokens`` tokens use it (the runner sets it from
    Env.pdl_max_tokens, ONECARD_PDL_MAX_TOKENS; 0 turns PDL off)."""

    max_tokens = 1


def set_pdl(max_tokens: int) -> None:
    _Pdl.max_tokens = int(max_tokens)


def pdl(device: torch.device, num_tokens: int) -> bool:
    """Launch this ``num_tokens``-token op with programmatic dependent launch? A real GPU and paths.use_pdl
    (sm90+: griddepcontrol). Batch 1 gains (H200: 322 -> 377 tok/s); see BENCHMARKS.md for the batch sizes
    measured."""
    return (device.type == "cuda" and not interpreting()
            and paths.use_pdl(num_tokens, compute_capability(device), _Pdl.max_tokens))


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel (complete, writes visible), then let the next one launch. No-op if not PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def stamp(ptr, after):
    """Diagnostics (benchmarks only, behind a kernel's TRACE constexpr): store this SM's cycle counter (%clock64)
    at ptr once ``after`` (any int scalar: the value whose computation the stamp must follow) is known, and
    return it. On a GPU only (inline PTX); 0 under the interpreter."""
    if NATIVE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [after.to(tl.int32)], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = after.to(tl.int64) * 0
    tl.store(ptr, t)
    return t


@triton.jit
def stamp_where(ptr, after):
    """stamp's companion: the global nanosecond timer (%globaltimer, comparable across SMs) at ptr and this
    program's SM (%smid) at ptr + 1, after ``after``."""
    if NATIVE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after.to(tl.int32)], dtype=tl.int64,
                                      is_pure=False, pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [after.to(tl.int32)], dtype=tl.int32,
                                       is_pure=False, pack=1)
    else:
        t = after.to(tl.int64) * 0
        sm = after.to(tl.int32) * 0
    tl.store(ptr, t)
    tl.store(ptr + 1, sm.to(tl.int64))


@triton.jit
def last_arrival(cnt_ptr, arrivals):
    """True in the program that arrives last (of ``arrivals``) at counter ``cnt_ptr``, which it resets to 0.

    Call after the program's partial results are stored: the barrier orders every thread's stores before the
    counter's release, and the last arriver's acquire makes them visible to it (read them with
    cache_modifier=".cg": L2, never a stale L1 line). See kernels/workspace.py for the zero invariant.
    """
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    return last


def settle_cache_keys(namespace: dict[str, Any]) -> None:
    """Compute the Triton cache key of every @triton.jit function a module defines, in definition order; each
    kernel module calls this last, with its globals().

    Why: Triton 3.6 folds a callee's constexpr globals (NATIVE, int4's PAIR_DIFFS_PTX) into its caller's key only
    when the callee's own key was computed before the caller's (JITFunction._update_hash merges
    func.used_global_vals before reading func.cache_key, which fills them). So a kernel's key depended on which
    kernels that process had keyed first: the start-up precompile's workers and the engine computed different
    keys for kernels calling the int4 helpers (or, then, a silu with a NATIVE branch), and the engine JIT-compiled
    those again
    (tests/gpu/test_precompile_gpu.py, intermittently). Keyed at import, helpers first (their modules are imported
    before their callers'), every process computes the same keys."""
    from triton.runtime.jit import JITFunction

    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.__module__ == namespace.get("__name__"):
            value.cache_key  # noqa: B018  (computed and cached on the function)


settle_cache_keys(globals())
