"""The inline PTX of gptq_gemm/int4 (byte_pair_diffs, half2_dot8), run by a small evaluator of the PTX ISA's
semantics for the instructions they use on random packed words, zeros and inputs, against n - z and the exact
sum computed from the GPTQ layout. No GPU runs here and the interpreter runs no inline PTX, so
this is what checks the shipped text's selectors, masks and magic numbers on the CPU; tests/gpu runs it for real.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("triton")
from onecard.kernels.gptq_gemm.int4 import PAIR_DIFFS_PTX

_U32 = np.uint32


def _imm(tok: str) -> np.ndarray:
    return _U32(int(tok, 0))


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """prmt.b32 d, a, b, c (default mode): byte i of d is byte c[4i+2:4i] of the 8-byte value {b, a}; c[4i+3]
    replicates that byte's sign bit instead."""
    pair = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=_U32)
    for i in range(4):
        nib = (int(sel) >> (4 * i)) & 0xF
        byte = ((pair >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)).astype(_U32)
        if nib & 8:
            byte = np.where(byte & 0x80, _U32(0xFF), _U32(0))
        out |= byte << _U32(8 * i)
    return out


def _lop3(a, b, c, lut: int) -> np.ndarray:
    """lop3.b32 d, a, b, c, immLut: bit k of d is bit (4a_k + 2b_k + c_k) of immLut (a=0xF0, b=0xCC, c=0xAA)."""
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=_U32)
    for idx in range(8):
        if (lut >> idx) & 1:
            ta = a if idx & 4 else ~a
            tb = b if idx & 2 else ~b
            tc = c if idx & 1 else ~c
            out |= ta & tb & tc
    return out


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A .b32 word's two fp16 halves (low first)."""
    return ((x & _U32(0xFFFF)).astype(np.uint16).view(np.float16),
            (x >> _U32(16)).astype(np.uint16).view(np.float16))


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two halves rounded once to fp16 (from float64: exact results) into a .b32 word."""
    return (lo.astype(np.float16).view(np.uint16).astype(_U32)
            | (hi.astype(np.float16).view(np.uint16).astype(_U32) << _U32(16)))


def _f16x2(op: str, a, b, c=None) -> np.ndarray:
    """sub / mul.rn / fma.rn .f16x2: each half's exact float64 result rounded once to fp16 (the operands here are
    fp16 values and small integers, whose products and sums float64 holds exactly)."""
    (alo, ahi), (blo, bhi) = _halves(a), _halves(b)
    alo, ahi = alo.astype(np.float64), ahi.astype(np.float64)
    if op == "sub":
        return _pack(alo - blo, ahi - bhi)
    lo, hi = alo * blo, ahi * bhi
    if op == "fma":
        clo, chi = _halves(c)
        lo, hi = lo + clo, hi + chi
    return _pack(lo, hi)


def run_ptx(text: str, args: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate a PTX block of the instructions int4's inline PTX uses (prmt.b32 default mode, shr.b32, lop3.b32,
    sub / mul.rn / fma.rn .f16x2, mov.b32 unpack into two .b16 / .f16, cvt.f32.f16, add.f32) on args: $i -> uint32
    arrays (inputs); returns every register after the block ($i outputs: fp16 arrays from an unpack, float32 from
    an f32 op)."""
    regs: dict[str, np.ndarray] = {f"${i}": v for i, v in args.items()}
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":
            m = re.fullmatch(r"\{([$\w]+), ([$\w]+)\}, (\w+)", rest)
            assert m, line
            regs[m.group(1)], regs[m.group(2)] = _halves(regs[m.group(3)])
            continue
        d, *src = [t.strip() for t in rest.split(",")]

        def val(t):
            return regs[t] if (t in regs) else _imm(t)
        if op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), int(src[2], 0))
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> _U32(int(src[1], 0))
        elif op == "lop3.b32":
            regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        elif op in ("sub.f16x2", "mul.rn.f16x2", "fma.rn.f16x2"):
            regs[d] = _f16x2(op.split(".")[0], *(val(t) for t in src))
        elif op == "cvt.f32.f16":
            regs[d] = val(src[0]).astype(np.float32)
        elif op == "add.f32":
            regs[d] = val(src[0]) + val(src[1])
        else:
            raise AssertionError(f"the evaluator does not know {op!r}: {line}")
    return regs


@pytest.mark.parametrize("b", range(4))
def test_pair_diffs_ptx_gives_exact_n_minus_z(b):
    rng = np.random.default_rng(b)
    qe = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(_U32)
    qo = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(_U32)
    z = rng.integers(0, 16, size=4096).astype(_U32)
    ze = (_U32(0x6400) + z) * _U32(0x10001)                               # int4.pair_zeros
    zo = (_U32(0x5400) + _U32(16) * z) * _U32(0x10001)
    regs = run_ptx(PAIR_DIFFS_PTX.value[b], {4: qe, 5: qo, 6: ze, 7: zo})
    out = {i: regs[f"${i}"] for i in range(4)}
    zi = z.astype(np.int64)

    def nib(q, j):
        return ((q.astype(np.int64) >> (4 * j)) & 0xF) - zi
    want = {0: nib(qe, 2 * b), 1: nib(qo, 2 * b), 2: nib(qe, 2 * b + 1), 3: nib(qo, 2 * b + 1)}
    for i in range(4):
        np.testing.assert_array_equal(out[i].astype(np.int64), want[i], err_msg=f"byte {b}, output ${i}")


def test_the_evaluator_fails_a_wrong_selector():
    """The check can fail: the selector's second byte one nibble too high (bits 16-19, which prmt ignores)."""
    good = PAIR_DIFFS_PTX.value[1]
    bad = good.replace(f"{1 | (5 << 8):#x}", f"{1 | (5 << 16):#x}")
    assert bad != good
    q = np.arange(1, 65, dtype=_U32) * _U32(0x01234567)
    zz = _U32(0x6400 * 0x10001)
    a = run_ptx(good, {4: q, 5: q[::-1].copy(), 6: zz, 7: _U32(0x5400 * 0x10001)})
    c = run_ptx(bad, {4: q, 5: q[::-1].copy(), 6: zz, 7: _U32(0x5400 * 0x10001)})
    assert not np.array_equal(a["$1"], c["$1"])



def _dot_case(seed: int, n: int = 4096):
    """Random packed words q, fp16 inputs x [n, 8] (x_j is input 8r + j), true zeros z: the PTX's operands
    (int4.half2_pairs' pairs, half2_zeros' word) and the exact sum_j (n_j - z) x_j with its scale sum_j |.|."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(_U32)
    x = (rng.standard_normal((n, 8)) * 2).astype(np.float16)
    z = rng.integers(0, 16, size=n).astype(_U32)
    terms = np.stack([((q.astype(np.int64) >> (4 * j)) & 0xF) - z.astype(np.int64) for j in range(8)], 1) \
        * x.astype(np.float64)                                            # [n, 8]
    args = {1: q, 6: (_U32(0x6400) + z) * _U32(0x10001)}
    for k in range(4):
        args[2 + k] = _pack(x[:, k], x[:, k + 4])                        # (x_k, x_k+4)
    return args, terms.sum(1), np.abs(terms).sum(1)


@pytest.mark.parametrize("seed", range(3))
def test_half2_dot8_ptx_sums_the_eight_products(seed):
    """$0 = sum_j (n_j - z) x_j within the four fp16 roundings of each half's chain (2**-9 of sum |terms|)."""
    from onecard.kernels.gptq_gemm.int4 import HALF2_DOT8_PTX

    args, exact, scale = _dot_case(seed)
    out = run_ptx(HALF2_DOT8_PTX.value, args)["$0"].astype(np.float64)
    assert np.all(np.abs(out - exact) <= 2.0**-9 * scale + 1e-6), np.max(np.abs(out - exact) / (scale + 1e-9))


def test_the_dot_check_fails_a_wrong_pairing():
    """The check can fail: nibbles 1 and 5 multiplied by the inputs of 2 and 6 (the shifts 4 and 8 swapped)."""
    from onecard.kernels.gptq_gemm.int4 import HALF2_DOT8_PTX

    good = HALF2_DOT8_PTX.value
    bad = good.replace("shr.b32 u, $1, 4;", "shr.b32 u, $1, @;").replace("shr.b32 u, $1, 8;", "shr.b32 u, $1, 4;") \
        .replace("shr.b32 u, $1, @;", "shr.b32 u, $1, 8;")
    assert bad != good
    args, exact, scale = _dot_case(7)
    out = run_ptx(bad, args)["$0"].astype(np.float64)
    assert not np.all(np.abs(out - exact) <= 2.0**-9 * scale + 1e-6)
