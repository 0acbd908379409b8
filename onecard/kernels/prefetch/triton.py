"""Triton L2 prefetch: bring the byte ranges of a prefetch table (table.py) into the GPU's L2; contract as ref.py.

One program per table row walks the row's touches (table.py's rule: one address per 128-byte line, clamped to
the row's last byte, so every line of the row and no byte outside it) and issues ``prefetch.global.L2`` for each
(``prefetch.global.L2::evict_last`` with ``evict_last``: sm80+, where the line is kept over the streaming
expert weights). A prefetch is fire-and-forget: the program holds no registers for the data and ends as soon as
its requests are issued, so the kernel occupies SM slots for a few microseconds only (the model launches it on a
side stream beside the MoE, layers/l2_prefetch.py). The asm has no output the program uses, so it is declared
impure (``is_pure=False``): the compiler keeps it (tests/kernels/test_l2_prefetch.py checks the PTX).
``touch_or`` runs the same walk with loads instead (MODE 2) and returns, per row, the OR of the bytes it touched:
the tests' view of which bytes the address arithmetic reaches; it is also what ``l2_prefetch`` runs under the
interpreter, which has no inline asm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.prefetch.table import LINE_BYTES
from onecard.kernels.triton_common import AotConfig, signature

BLOCK = 256                           # touches per loop trip (128 threads, 2 each)
WARPS = 4
PREFETCH, PREFETCH_EVICT_LAST, TOUCH_OR = 0, 1, 2      # MODE


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _l2_prefetch_kernel(table_ptr, out_ptr, LINE: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    row = tl.program_id(0)
    addr = tl.load(table_ptr + 2 * row)                                   # int64: the row's first byte
    n = tl.load(table_ptr + 2 * row + 1)                                  # int64 bytes (> 0)
    touches = (n + LINE - 1) // LINE + 1
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, touches, BLOCK):
        i = start + tl.arange(0, BLOCK).to(tl.int64)                      # [BLOCK]; past the end: clamped
        a = addr + tl.minimum(i * LINE, n - 1)                            # [BLOCK] int64 addresses in the row
        if MODE == 2:
            acc = acc | tl.load(a.to(tl.pointer_type(tl.uint8))).to(tl.int32)
        elif MODE == 1:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [a],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [a],
                                      dtype=tl.int32, is_pure=False, pack=1)
    if MODE == 2:
        tl.store(out_ptr + row, tl.reduce(acc, 0, _bit_or))


def _launch(table: torch.Tensor, out: torch.Tensor, mode: int) -> None:
    assert table.dtype == torch.int64 and table.dim() == 2 and table.shape[1] == 2 and table.is_contiguous()
    _l2_prefetch_kernel[(table.shape[0],)](table, out, LINE=LINE_BYTES, BLOCK=BLOCK, MODE=mode, num_warps=WARPS)


def l2_prefetch(table: torch.Tensor, evict_last: bool = False) -> None:
    if table.shape[0] == 0:
        return
    if table.device.type != "cuda":           # the interpreter: no inline asm; the loads walk the same addresses
        touch_or(table)
        return
    _launch(table, table, PREFETCH_EVICT_LAST if evict_last else PREFETCH)   # (out_ptr unused: nothing written)


def touch_or(table: torch.Tensor) -> torch.Tensor:
    """-> int32 [R]: per row, the OR of every byte (as uint8) the prefetch walk touches."""
    out = torch.zeros(table.shape[0], dtype=torch.int32, device=table.device)
    if table.shape[0]:
        _launch(table, out, TOUCH_OR)
    return out


def aot_configs() -> list[AotConfig]:
    """The prefetch (every target), its evict_last form (sm80+: the PTX qualifier needs it) and the test walk."""
    args = dict(table_ptr="*i64", out_ptr="*i64")
    out = []
    for mode, min_cc, name in ((PREFETCH, 70, "l2"), (PREFETCH_EVICT_LAST, 80, "evict_last"), (TOUCH_OR, 70, "touch")):
        cx = dict(LINE=LINE_BYTES, BLOCK=BLOCK, MODE=mode)
        a = dict(args, out_ptr="*i32") if mode == TOUCH_OR else args
        out.append(AotConfig(_l2_prefetch_kernel, signature(a, cx), cx, WARPS, 1, min_cc, f"l2_prefetch[{name}]"))
    return out
