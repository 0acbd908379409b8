"""FP8 KV caches in the reference kernels (the spec, attention/fp8.py) against independent references.

- e5m2 store is exactly the upper byte of the fp16 rounded to nearest even, on every fp16 bit pattern
  (kernels_testlib.e5m2_bits_np, numpy from the definition) and loads back as that fp16.
- e4m3 round trip: within half an ulp (2^-4 relative, or half a subnormal step) and saturated at 448 x scale.
- paged attention reading fp8 K/V against float32 attention on the exact K/V: within the bound derived from the
  format's precision (kernels_testlib.fp8_attention_bound), and equal to attention on the dequantized cache.
The Triton twins are checked against these under the interpreter (interpret_cases.py, FP8_CASES).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kernels_testlib import e5m2_bits_np, fp8_attention_bound, make_paged_batch

from onecard.kernels.attention import fp8, ref


def all_fp16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)


def test_e5m2_store_is_fp16_upper_byte_rne():
    h = all_fp16()
    got = fp8.quantize(h, fp8.E5M2).view(torch.uint8).numpy()
    want = e5m2_bits_np(h.numpy())
    nan = h.isnan().numpy()
    assert (got[~nan] == want[~nan]).all()
    assert fp8.quantize(h, fp8.E5M2)[torch.from_numpy(nan)].float().isnan().all()
    # load: the fp16 whose bits are byte << 8, exactly
    b = torch.arange(256, dtype=torch.int32)
    shifted = (b << 8).to(torch.int16).view(torch.float16).float()
    deq = fp8.dequantize(b.to(torch.uint8).view(fp8.E5M2))
    same = (deq == shifted) | (deq.isnan() & shifted.isnan())
    assert same.all()


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_e4m3_round_trip_within_precision(scale):
    x = torch.cat([torch.randn(20000) * 40, torch.randn(2000) * 0.01, torch.tensor([1e4, -1e4, 0.0])]) * scale
    back = fp8.dequantize(fp8.quantize(x, fp8.E4M3, scale), scale)
    inside = (x / scale).abs() <= 448
    err = (back - x).abs()
    assert (err[inside] <= x[inside].abs() * 2.0 ** -4 + 2.0 ** -10 * scale + 1e-12).all()
    assert torch.equal(back[~inside], (x[~inside].sign() * 448 * scale))


@pytest.mark.parametrize("fmt,k_scale,v_scale", [("e5m2", 1.0, 1.0), ("e4m3", 1.0, 1.0), ("e4m3", 0.3, 4.0)])
@pytest.mark.parametrize("seq_lens,query_lens", [([5, 40, 1], [5, 3, 1]), ([70], [70])])
def test_paged_attention_fp8_within_format_bound(fmt, k_scale, v_scale, seq_lens, query_lens):
    hq, hkv, d, bs = 8, 2, 32, 16
    kc, vc, md, ks, vs = make_paged_batch(seq_lens, query_lens, hkv, d, bs, seed=3)
    cdt = fp8.E5M2 if fmt == "e5m2" else fp8.E4M3
    k8, v8 = fp8.quantize(kc, cdt, k_scale), fp8.quantize(vc, cdt, v_scale)
    q = torch.randn(sum(query_lens), hq, d)
    s = 1 / math.sqrt(d)
    out = ref.paged_attention(q, k8, v8, md, s, k_scale, v_scale)
    exact = ref.paged_attention(q, kc, vc, md, s)
    bound = fp8_attention_bound(q, ks, vs, query_lens, fmt, s, k_scale, v_scale)
    ratio = ((out.double() - exact.double()).abs() / (bound + 1e-6)).max().item()
    assert ratio <= 1.0, ratio
    assert (out - exact).abs().max() > 0                  # the cache really is fp8
    # the same attention on the dequantized cache: reading fp8 is exactly "dequantize, then attend"
    deq = ref.paged_attention(q, fp8.dequantize(k8, k_scale), fp8.dequantize(v8, v_scale), md, s)
    assert torch.allclose(out, deq, rtol=1e-5, atol=1e-6)


def test_store_kv_fp8_skips_negative_slots_and_scales():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc = torch.zeros(2, 4, 2, 8, dtype=torch.uint8).view(fp8.E4M3)
    vc = torch.zeros(2, 4, 2, 8, dtype=torch.uint8).view(fp8.E4M3)
    ref.store_kv(k, v, kc, vc, torch.tensor([5, -1, 0]), 0.5, 2.0)
    flat_k, flat_v = kc.view(8, 2, 8), vc.view(8, 2, 8)
    assert torch.equal(flat_k[5], fp8.quantize(k[0], fp8.E4M3, 0.5))
    assert torch.equal(flat_v[0], fp8.quantize(v[2], fp8.E4M3, 2.0))
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert (flat_k[untouched].view(torch.uint8) == 0).all()
    assert np.allclose(fp8.dequantize(flat_k[5], 0.5).numpy(), k[0].numpy(), rtol=2 ** -4, atol=2 ** -10)
