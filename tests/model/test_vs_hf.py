"""Our Qwen3 / Qwen3-MoE (loader + model + ref kernels, float32, CPU) against HF transformers' own classes.

Every check runs a whole sequence through HF without a cache and compares the logits of our paged,
flattened-batch forward at the same positions: a mixed-length batched prefill, 20 batched decode steps
through the paged cache, and chunked prefill over a cached prefix mixed with decodes.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.model.common import ATOL, RTOL, hf_logits, load_hf, load_ours, prompts
from tests.model.paged import PagedCache


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tiny_dense_dir, tiny_moe_dir):
    d = tiny_dense_dir if request.param == "dense" else tiny_moe_dir
    return load_ours(d), load_hf(d)


def _vocab(model) -> int:
    return int(model.config["vocab_size"])


def test_batched_prefill(pair):
    ours, hf = pair
    seqs = prompts(_vocab(ours), [1, 7, 16, 23], seed=1)
    cache = PagedCache.for_model(ours, num_blocks=64, block_size=4)
    outs = cache.step(ours, [(cache.new_seq(), s) for s in seqs])
    for s, h in zip(seqs, outs):
        torch.testing.assert_close(ours.compute_logits(h), hf_logits(hf, s), rtol=RTOL, atol=ATOL)


def test_decode_20_steps(pair):
    ours, hf = pair
    v = _vocab(ours)
    seqs = prompts(v, [5, 12, 3], seed=2)
    conts = prompts(v, [20, 20, 20], seed=3)
    cache = PagedCache.for_model(ours, num_blocks=64, block_size=4)
    ids = [cache.new_seq() for _ in seqs]
    cache.step(ours, list(zip(ids, seqs)))
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for t in range(20):
        outs = cache.step(ours, [(sid, [conts[i][t]]) for i, sid in enumerate(ids)])
        for i, h in enumerate(outs):
            got[i].append(ours.compute_logits(h)[0])
    for i, s in enumerate(seqs):
        ref = hf_logits(hf, s + conts[i])[len(s):]                         # logits after each decode input
        torch.testing.assert_close(torch.stack(got[i]), ref, rtol=RTOL, atol=ATOL)


def test_chunked_prefill_over_cached_prefix(pair):
    ours, hf = pair
    v = _vocab(ours)
    long, other = prompts(v, [29, 6], seed=4)
    cache = PagedCache.for_model(ours, num_blocks=64, block_size=4)
    a, b = cache.new_seq(), cache.new_seq()
    first = cache.step(ours, [(b, other), (a, long[:6])])                 # prefill b + first chunk of a
    got = [ours.compute_logits(first[1])]
    decoded = list(other)
    bounds = [6, 13, 14, 25, 29]                                           # odd chunks, one of length 1
    for lo, hi in itertools.pairwise(bounds):
        nxt = int(torch.randint(3, v, (1,), generator=torch.Generator().manual_seed(hi)))
        outs = cache.step(ours, [(b, [nxt]), (a, long[lo:hi])])           # decode first, then the chunk
        decoded.append(nxt)
        got.append(ours.compute_logits(outs[1]))
        torch.testing.assert_close(ours.compute_logits(outs[0]), hf_logits(hf, decoded)[-1:],
                                   rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, long), rtol=RTOL, atol=ATOL)


def test_greedy_not_degenerate(pair):
    """The fixture must make greedy decoding informative: HF's greedy continuation varies."""
    _, hf = pair
    out = hf.generate(torch.tensor([prompts(_vocab(pair[0]), [8], seed=5)[0]]), max_new_tokens=16,
                      do_sample=False)
    assert len(set(out[0, 8:].tolist())) > 4
