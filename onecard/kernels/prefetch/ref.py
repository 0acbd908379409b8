"""Reference L2 prefetch: a no-op. A prefetch changes no value anywhere (the spec the Triton kernel is held to:
same signature, nothing written, every read inside the table's ranges; tests/kernels/test_l2_prefetch.py).

Contract: ``l2_prefetch(table[R, 2] int64 (address, nbytes), evict_last=False) -> None`` (table: prefetch/table.py).
"""
from __future__ import annotations

import torch


def l2_prefetch(table: torch.Tensor, evict_last: bool = False) -> None:
    del table, evict_last
