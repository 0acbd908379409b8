"""Persistent zero-initialised scratch for kernels that finish their own reductions ("last arriver").

Split-K GEMMs, the decode MoE and split-KV attention end with a reduction across programs. Instead of a
second kernel launch (a CUDA-graph node: ~2-3 µs each, ~20 per layer before this existed), every program
bumps a counter when its partial result is out, and the program that arrives last does the reduction, then
puts its counter (and any accumulator it used) back to zero. So the invariant is: **between kernel launches
every word of these buffers is zero.** One buffer per device serves every kernel because launches on the
engine's stream never overlap.

Contract: ``counters(device, region, n) -> int32 [n]`` and ``accumulator(device, n) -> fp32 [n] | None``
(None when n exceeds the fixed size: callers fall back to a zeroed temporary and a reduce kernel). Buffers are
allocated once, outside CUDA-graph capture (the first eager call allocates them; the runner warms up every
graph before capturing it), and never reallocated, so captured graphs keep pointing at live memory.
"""
from __future__ import annotations

import torch

# region -> first counter; each region is REGION_SIZE int32 words
REGIONS = {"gemm": 0, "moe": 1, "attention": 2}
REGION_SIZE = 1 << 14
ACCUMULATOR_SIZE = 1 << 20            # fp32 words: M x N of a small-M GEMM up to 16 x 65,536

_COUNTERS: dict[str, torch.Tensor] = {}
_ACCUMULATORS: dict[str, torch.Tensor] = {}


def _get(store: dict[str, torch.Tensor], device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    key = str(device)
    buf = store.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernel workspace first used inside CUDA-graph capture: run the op eagerly "
                               "once before capturing")
        buf = store[key] = torch.zeros(numel, dtype=dtype, device=device)
    return buf


def counters(device: torch.device, region: str, n: int) -> torch.Tensor:
    """int32 [n] zeros (the kernel that uses them must leave them zero)."""
    if n > REGION_SIZE:
        raise ValueError(f"{n} counters exceed the workspace region ({REGION_SIZE})")
    base = REGIONS[region] * REGION_SIZE
    return _get(_COUNTERS, device, len(REGIONS) * REGION_SIZE, torch.int32)[base:base + n]


def accumulator(device: torch.device, n: int) -> torch.Tensor | None:
    """fp32 [n] zeros (the kernel that uses them must leave them zero), or None when n is too large."""
    if n > ACCUMULATOR_SIZE:
        return None
    return _get(_ACCUMULATORS, device, ACCUMULATOR_SIZE, torch.float32)[:n]


__all__ = ["counters", "accumulator", "REGIONS"]
