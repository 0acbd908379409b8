"""fused_moe/router_fold.py's fact, on the CPU: the router's logits of the post-attention norm's output are rstd
times (gate * nw) @ x, and x = r + a @ W_o splits them into F @ r + M @ a, with (F, M) from ``build`` (built from
random GPTQ weights and an independent dense copy of them, kernels_testlib.random_gptq)."""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_testlib import random_gptq

from onecard.kernels.fused_moe import router_fold
from onecard.kernels.norm import ref as norm_ref


def _layer(dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    h, k_o, e = 256, 384, 12
    w_o, dense = random_gptq(k_o, h, 128, seed=seed)                     # o = a @ dense, dense [K_o, H]
    gate = (torch.randn(e, h) / math.sqrt(h)).to(dtype)
    nw = (1 + 0.1 * torch.randn(h)).to(dtype)
    return w_o, dense, gate, nw


def test_build_is_gate_times_norm_weight_and_its_product_with_the_o_projection():
    w_o, dense, gate, nw = _layer(torch.float32)
    fold = router_fold.build(gate, nw, w_o)
    f = gate * nw[None, :]
    assert fold.f.dtype == gate.dtype and fold.m.dtype == gate.dtype
    torch.testing.assert_close(fold.f, f, rtol=0, atol=0)
    torch.testing.assert_close(fold.m, f @ dense.t(), rtol=1e-5, atol=1e-5)


def test_folded_sums_times_rstd_are_the_routers_logits():
    """rstd * (F @ r + M @ a) = gate @ rms_norm(r + a @ W_o) * nw, up to the model dtype's rounding (fp16: the
    reference rounds x, h and the logits; here only F and M are rounded)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        w_o, dense, gate, nw = _layer(dtype, seed=3)
        fold = router_fold.build(gate, nw, w_o)
        a = torch.randn(1, dense.shape[0])
        r = torch.randn(1, dense.shape[1]).to(dtype)
        o = a @ dense                                                      # [1, H] fp32
        raw = r.float() @ fold.f.float().t() + a @ fold.m.float().t()     # [1, E]: what o_proj's programs add
        x = o + r.float()
        torch.testing.assert_close(raw, router_fold.raw_ref(fold, x), rtol=tol, atol=tol)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        hn, _ = norm_ref.rms_norm(o.to(dtype), nw, 1e-6, r)                # the model's path (its dtype)
        want = hn.float() @ gate.float().t()
        err = float((rstd * raw - want).abs().max() / want.abs().max())
        assert err < tol, err
        wrong = float(((raw - want).abs().max()) / want.abs().max())       # without rstd: not the logits
        assert wrong > 10 * tol
