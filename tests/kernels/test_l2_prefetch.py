"""The L2 prefetch kernel (kernels/prefetch): its reference is a no-op, so what is tested is that it reads inside
its table's ranges, reaches every cache line of them, and writes nothing.

Under TRITON_INTERPRET=1 (a subprocess, as test_triton_interpret.py) the kernel's walk runs with loads in place
of the prefetch instruction (``touch_or``: per row, the OR of the bytes touched). The buffers hold a distinct bit
per cache line inside the ranges (line index mod 7) and 0x80 outside, so a row's OR is exactly the bits of the
lines it spans iff every line is touched and no byte outside the row is. The PTX of the real prefetch is checked
for the instruction (it has no output: declared impure, it must survive compilation) and for no stores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from onecard.kernels.prefetch import ref
from onecard.kernels.prefetch.table import CHUNK_BYTES, LINE_BYTES, prefetch_table, table_rows, tensor_span

triton = pytest.importorskip("triton")
GUARD = 0x80
# (offset into the buffer, bytes): misaligned starts and ends, one byte, exactly a line, across chunk edges
RANGES = [(0, 1), (130, 127), (384, 128), (645, 129), (1063, 700), (2100, 1537), (4000, 255)]
CHUNK = 600                             # <= 6 lines per row: a missed line shows as a missing bit
BIG = (8192, 3 * 256 * LINE_BYTES + 77)  # one row of > 3 loop trips (256 touches each)


def _pattern(buf: torch.Tensor, lo: int, n: int) -> None:
    base = buf.data_ptr()
    lines = (torch.arange(lo, lo + n, dtype=torch.int64) + base) // LINE_BYTES
    buf[lo:lo + n] = (1 << (lines % 7)).to(torch.uint8)


def _want(addr: int, n: int) -> int:
    return int(sum({1 << (line % 7) for line in range(addr // LINE_BYTES, (addr + n - 1) // LINE_BYTES + 1)}))


def _interpret_worker() -> dict:
    """Runs in the subprocess (TRITON_INTERPRET=1)."""
    from onecard.kernels import dispatch
    from onecard.kernels.prefetch import triton as tk

    out: dict = {}
    buf = torch.full((16384 + 2 * BIG[1],), GUARD, dtype=torch.uint8)
    for lo, n in RANGES:
        _pattern(buf, lo, n)
    views = [buf[lo:lo + n] for lo, n in RANGES]
    table = prefetch_table(views, torch.device("cpu"), chunk=CHUNK)
    before = buf.clone()
    got = tk.touch_or(table).tolist()
    want = [_want(a, n) for a, n in table.tolist()]
    out["rows"] = len(want)
    out["bad_rows"] = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    # the big row: all in-range bytes 1 (guards 0x80 around it), then each probed line alone 1, the rest 0
    lo, n = BIG
    big = buf[lo:lo + n]
    big.fill_(1)
    table1 = prefetch_table([big], torch.device("cpu"), chunk=n)
    out["big_rows"] = table1.shape[0]
    out["big_or"] = tk.touch_or(table1).tolist()
    first_line = big.data_ptr() // LINE_BYTES
    last_line = (big.data_ptr() + n - 1) // LINE_BYTES
    missed = []
    for line in (first_line, first_line + 255, first_line + 256, first_line + 513, last_line):
        big.zero_()
        a = max(line * LINE_BYTES, big.data_ptr()) - big.data_ptr()
        z = min((line + 1) * LINE_BYTES, big.data_ptr() + n) - big.data_ptr()
        big[a:z] = 1
        if tk.touch_or(table1).tolist() != [1]:
            missed.append(line - first_line)
    out["big_missed_lines"] = missed
    # the op through dispatch (auto picks triton under the interpreter, as the runner sets it): changes no byte,
    # nor the table
    dispatch.set_default_backend("auto", interpret=True)
    big.fill_(1)
    before, tbefore = buf.clone(), table.clone()
    dispatch.l2_prefetch(table)
    dispatch.l2_prefetch(table, evict_last=True)
    out["unchanged"] = bool(torch.equal(buf, before) and torch.equal(table, tbefore))
    out["backend"] = dispatch.backend_for(table.device)
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import json, tests.kernels.test_l2_prefetch as t; print(json.dumps(t._interpret_worker()))"
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_walk_reaches_every_line_and_nothing_outside(interpreted):
    assert interpreted["backend"] == "triton"
    assert interpreted["rows"] > len(RANGES)                         # the 600-byte chunks split some ranges
    assert interpreted["bad_rows"] == []


def test_multi_trip_row(interpreted):
    assert interpreted["big_rows"] == 1
    assert interpreted["big_or"] == [1]                              # in bounds (guards are 0x80)
    assert interpreted["big_missed_lines"] == []                     # trip edges and both ends reached


def test_prefetch_changes_nothing(interpreted):
    assert interpreted["unchanged"]


def test_reference_is_a_noop_with_the_same_signature():
    import inspect

    from onecard.kernels.prefetch import triton as tk

    assert inspect.signature(ref.l2_prefetch) == inspect.signature(tk.l2_prefetch)
    x = torch.arange(1000, dtype=torch.uint8)
    t = prefetch_table([x], torch.device("cpu"))
    before = x.clone()
    assert ref.l2_prefetch(t) is None and torch.equal(x, before)


def test_table_rows_split_and_span():
    x = torch.zeros(3, 5, dtype=torch.float16)
    assert tensor_span(x[:, 1:3]) == (x.data_ptr() + 2, (2 * 5 + 2 - 1 + 1) * 2)   # x[0, 1] .. x[2, 2]
    assert tensor_span(torch.empty(0))[1] == 0
    big = torch.zeros(CHUNK_BYTES + 10, dtype=torch.uint8)
    rows = table_rows([big, torch.empty(0), x], chunk=CHUNK_BYTES)
    assert rows == [(big.data_ptr(), CHUNK_BYTES), (big.data_ptr() + CHUNK_BYTES, 10), (x.data_ptr(), 30)]


@pytest.mark.parametrize("cc,evict_last", [(70, False), (90, False), (90, True)])
def test_ptx_keeps_the_prefetch_and_stores_nothing(cc, evict_last):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onecard.kernels.prefetch import triton as tk

    c = next(c for c in tk.aot_configs() if c.name == f"l2_prefetch[{'evict_last' if evict_last else 'l2'}]")
    k = triton.compile(ASTSource(fn=c.kernel, signature=c.signature, constexprs=c.constexprs),
                       target=GPUTarget("cuda", cc, 32), options=dict(num_warps=c.num_warps, num_stages=1))
    ptx = k.asm["ptx"]
    op = "prefetch.global.L2::evict_last" if evict_last else "prefetch.global.L2"
    assert ptx.count(op) >= tk.BLOCK // (32 * tk.WARPS)             # one per touch a thread holds per trip
    assert "st.global" not in ptx and "atom." not in ptx
