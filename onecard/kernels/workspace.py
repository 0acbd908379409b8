"""Persistent zero-initialised scratch for kernels that finish their own reductions ("last arriver").

Split-K GEMMs, the decode MoE and the batch-1 router end with a reduction across programs. Instead of a
second kernel launch (a CUDA-graph node: ~2-3 µs each, ~20 per layer before this existed), every program
bumps a counter when its partial result is out, and the program that arrives last does the reduction, then
puts its counter back to zero. So the invariant is: **between kernel launches
every word of these buffers is zero.** One buffer per device serves every kernel because launches on the
engine's stream never overlap.

Only counters: fp32 partial sums cannot live in such a buffer (another CTA's fp32 atomics are not ordered
before an arrival counter; a reduce kernel that read and re-zeroed a persistent accumulator gave wrong sums on
the H200), so those use zeroed temporaries.

Contract: ``counters(device, region, n) -> int32 [n]``. Buffers are allocated once, outside CUDA-graph
capture (the first eager call allocates them; the runner warms up every graph before capturing it), and never
reallocated, so captured graphs keep pointing at live memory.
"""
from __future__ import annotations

import torch

# region -> first counter; each region is REGION_SIZE int32 words
REGIONS = {"gemm": 0, "moe": 1, "router": 2}
REGION_SIZE = 1 << 14

_COUNTERS: dict[str, torch.Tensor] = {}


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


__all__ = ["REGIONS", "counters"]
