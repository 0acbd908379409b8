"""The prefill attention on PyTorch's SDPA (attention/sdpa.py, below sm80) against the float32 reference on the CPU,
the batch cut that leaves the other sequences to the Triton kernel (metadata.select), and which sequences the
path takes (paths.prefill_sdpa). The Triton wrapper with both halves runs under the interpreter in
interpret_cases.py's ``attnsdpa`` cases; the memory-efficient kernel itself in tests/gpu/test_pre_ampere_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch
from kernels_testlib import make_paged_batch, rel_err

from onecard.kernels import paths
from onecard.kernels.attention import fp8, ref, sdpa
from onecard.kernels.attention.metadata import select


def _batch(seq_lens, q_lens, hkv, block, dtype, seed=0, decodes=0, pad_rows=0):
    kc, vc, md, _, _ = make_paged_batch(seq_lens, q_lens, hkv, 32, block, dtype=dtype, seed=seed, pad_rows=pad_rows)
    md.num_decode_tokens = decodes
    md.host_query_start_loc, md.host_seq_lens = md.query_start_loc.numpy(), md.seq_lens.numpy()
    return kc, vc, md


# (contexts, new tokens, Hq, Hkv, block size): one prompt; a chunk over a cached prefix; GQA 8:1 over blocks of 16
# with a decode and a padding row; MHA (1:1); a context ending inside a block of 64
CASES = [([40], [40], 8, 2, 16), ([90], [25], 4, 1, 8), ([7, 200, 50], [1, 120, 50], 16, 2, 16),
         ([33, 18], [30, 18], 2, 2, 4), ([130], [70], 6, 3, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sdpa_matches_reference(case, dtype):
    seq_lens, q_lens, hq, hkv, block = CASES[case]
    kc, vc, md = _batch(seq_lens, q_lens, hkv, block, dtype, seed=case, decodes=int(q_lens[0] == 1), pad_rows=1)
    q = torch.randn(sum(q_lens) + 1, hq, 32).to(dtype)
    got = sdpa.paged_attention(q, kc, vc, md, 1 / math.sqrt(32))
    want = ref.paged_attention(q.float(), kc, vc, md, 1 / math.sqrt(32))
    assert got.dtype == dtype and bool((got[-1] == 0).all())                 # the padding row stays zero
    assert rel_err(got, want) < (1e-2 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_sdpa_reads_fp8_caches_with_their_scales(fmt):
    seq_lens, q_lens, hq, hkv, block = CASES[2]
    kc, vc, md = _batch(seq_lens, q_lens, hkv, block, torch.float16, decodes=1)
    cdt = fp8.E5M2 if fmt == "e5m2" else fp8.E4M3
    k_scale, v_scale = (1.0, 1.0) if fmt == "e5m2" else (0.37, 2.5)
    kq, vq = fp8.quantize(kc, cdt, k_scale), fp8.quantize(vc, cdt, v_scale)
    q = torch.randn(sum(q_lens), hq, 32).half()
    got = sdpa.paged_attention(q, kq, vq, md, 0.2, k_scale, v_scale)
    want = ref.paged_attention(q.float(), kq, vq, md, 0.2, k_scale, v_scale)   # the same bytes, read as stored x scale
    assert rel_err(got, want) < 1e-2
    if fmt == "e4m3":                                                          # the scales are applied
        assert rel_err(got, ref.paged_attention(q.float(), kq, vq, md, 0.2)) > 0.05


def test_select_keeps_each_sequences_rows():
    """Attention over the selected sequences alone = those rows of the whole batch's (the kernel's half of a
    split launch), with the leading decodes still leading."""
    kc, vc, md = _batch([9, 12, 60, 30, 45], [1, 1, 40, 3, 20], 2, 8, torch.float32, decodes=2)
    q = torch.randn(65, 4, 32)
    whole = ref.paged_attention(q, kc, vc, md, 0.3)
    sub, rows = select(md, [0, 1, 3])
    assert sub.num_decode_tokens == 2 and sub.max_query_len == 3 and sub.max_seq_len == 30
    assert rows.tolist() == [0, 1, 42, 43, 44]
    assert sub.host_query_start_loc.tolist() == [0, 1, 2, 5] == sub.query_start_loc.tolist()
    assert torch.equal(ref.paged_attention(q[rows], kc, vc, sub, 0.3), whole[rows])
    sub2, rows2 = select(md, [2, 4])
    assert sub2.num_decode_tokens == 0 and rows2.tolist() == list(range(2, 42)) + list(range(45, 65))
    with pytest.raises(AssertionError, match="decodes must lead"):
        select(md, [1, 2])


def test_which_sequences_take_sdpa():
    _, _, md = _batch([9, 200, 40, 17], [1, 120, 16, 17], 2, 16, torch.float32, decodes=1)
    assert sdpa.long_sequences(md, 70) == sdpa.long_sequences(md, 75) == [1, 3]   # more than the verify rows
    assert sdpa.long_sequences(md, 80) == sdpa.long_sequences(md, 90) == []       # tensor-core tl.dot: the kernel
    paths.set_switch("prefill_sdpa", False)
    try:
        assert sdpa.long_sequences(md, 70) == []
    finally:
        paths.set_switch("prefill_sdpa", None)
    md.host_query_start_loc = None                                                 # CUDA graphs' metadata
    assert sdpa.long_sequences(md, 70) == []
    assert sdpa.available(torch.device("cpu"))
