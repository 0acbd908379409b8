"""The prefetch table: which bytes an ``l2_prefetch`` launch brings into L2.

Contract: ``prefetch_table(tensors, device) -> int64 [R, 2]`` on ``device``: one row (address, nbytes) per chunk
of at most ``CHUNK_BYTES`` of each tensor's storage span (``tensor_span``), empty tensors skipped, the tensors'
order kept (the first needed first). One kernel program serves one row, so the chunk size sets the grid: the
~10 MB of a Qwen3-30B-A3B layer's dense weights are ~45 programs. The addresses are the tensors' own: the table
is valid while they live where they are (build it after the weights are loaded, rebuild it if they move).
Touch rule (the kernel's, and the tests'): a row (a, n) touches bytes a + min(i * LINE_BYTES, n - 1) for
i = 0 .. ceil(n / LINE_BYTES); consecutive touches are at most one line apart and the last is byte n - 1, so
every cache line that holds a byte of the row is touched and no byte outside it is.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

LINE_BYTES = 128                      # an L2 cache line on every NVIDIA GPU onecard runs on (sm70..sm90)
CHUNK_BYTES = 256 << 10               # bytes per program (2,049 touches: a few loop trips of one warp group)


def tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte's address, bytes) of the storage a tensor view reads (its first to its last element)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))       # element offset of the last element
    return t.data_ptr(), (last + 1) * t.element_size()


def table_rows(tensors: Iterable[torch.Tensor], chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    rows: list[tuple[int, int]] = []
    for t in tensors:
        addr, n = tensor_span(t)
        rows += [(addr + o, min(chunk, n - o)) for o in range(0, n, chunk)]
    return rows


def prefetch_table(tensors: Iterable[torch.Tensor], device: torch.device, chunk: int = CHUNK_BYTES) -> torch.Tensor:
    rows = table_rows(tensors, chunk)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2).to(device)   # [R, 2]


def table_bytes(table: torch.Tensor) -> int:
    return int(table[:, 1].sum()) if table.numel() else 0
