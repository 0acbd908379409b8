"""GPU correctness of every Triton kernel vs its ref at the real Qwen3-30B-A3B shapes (bench/kernels_gpu.py's
cases, without the timing). Skipped without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))


def _cases():
    if not torch.cuda.is_available():
        return []
    import kernels_gpu
    return list(kernels_gpu.cases(quick=True))


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_triton_vs_ref_real_shapes(case):
    import kernels_gpu
    name, tri, rf, _ = case
    err = kernels_gpu.rel(tri(), rf())
    assert err < 1e-2, f"{name}: relative error {err:.3g}"
