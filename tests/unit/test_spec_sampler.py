"""Rejection sampling of speculative drafts (``Sampler.verify``) keeps the plain sampler's distribution.

A context-free toy model (fixed logits per position, vocabulary of 6) is verified with two point drafts many
times in one batch, with a fixed seed (deterministic, not flaky). The emitted tokens' distribution must pass a
chi-square test against the distribution the plain sampler draws from at each position (temperature, top-k,
top-p, min-p, penalties), and the plain sampler's own histogram must pass the same test (the reference is the
right one). The 0.999 quantiles of chi-square are written out below (df = cells - 1).
"""
from __future__ import annotations

import pytest
import torch

from onecard.runner.sampler import Sampler, SamplingBatch, _probs

_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
V = 6


def _batch(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingBatch:
    def full(v, dtype=torch.float32):
        return torch.full((rows,), v, dtype=dtype)

    return SamplingBatch(temperature=full(temperature), top_p=full(top_p), top_k=full(top_k, torch.int64),
                         min_p=full(min_p), all_greedy=False, any_top_p_k=top_k > 0 or top_p < 1.0,
                         any_min_p=min_p > 0, generators=[None] * rows)


def _chi2_ok(counts: torch.Tensor, p: torch.Tensor) -> None:
    n = int(counts.sum())
    support = p > 0
    assert int(counts[~support].sum()) == 0, "a token outside the distribution's support was emitted"
    exp = p[support] * n
    stat = float(((counts[support].float() - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    assert stat < _CHI2_999[df], (stat, counts.tolist(), (p * n).tolist())


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8, min_p=0.1)])
def test_rejection_sampling_matches_plain_sampling(params):
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5                 # positions 0, 1 (drafts) and 2 (bonus): [3, V]
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]   # a likely and a less likely draft
    n = 20000
    sampler = Sampler(seed=1234, device=torch.device("cpu"))
    rows = logits.repeat(n, 1)                                          # [3n, V]: request i owns rows 3i..3i+2
    draft_t = torch.tensor([drafts[0], drafts[1], -1] * n)
    sample, accept = sampler.verify(rows, _batch(3 * n, **params), draft_t)
    sample, accept = sample.view(n, 3), accept.view(n, 3)
    p = _probs(logits, _batch(3, **params))
    p = p / p.sum(-1, keepdim=True)                                     # [3, V] what a plain step draws from
    # emitted tokens: the accepted draft prefix, then the sample at the first rejection (or the bonus)
    first = torch.where(accept[:, 0], torch.tensor(drafts[0]), sample[:, 0])
    _chi2_ok(torch.bincount(first, minlength=V), p[0])
    a0 = accept[:, 0]
    second = torch.where(accept[a0, 1], torch.tensor(drafts[1]), sample[a0, 1])
    _chi2_ok(torch.bincount(second, minlength=V), p[1])
    both = a0 & accept[:, 1]
    assert int(both.sum()) > 500 and int((~a0).sum()) > 500            # both paths ran often
    _chi2_ok(torch.bincount(sample[both, 2], minlength=V), p[2])
    # the reference: the plain sampler's own draws pass the same test
    plain = Sampler(seed=99, device=torch.device("cpu")).sample(logits[:1].repeat(n, 1), _batch(n, **params))
    _chi2_ok(torch.bincount(plain.token_ids, minlength=V), p[0])


def test_greedy_rows_and_impossible_drafts():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 5.0]])
    greedy = SamplingBatch(temperature=None, top_p=None, top_k=None, min_p=None, all_greedy=True, any_top_p_k=False,
                           any_min_p=False, generators=[None, None])
    s, a = Sampler(0, torch.device("cpu")).verify(logits, greedy, torch.tensor([1, 0]))
    assert s.tolist() == [1, 3] and a.tolist() == [True, False]
    # a draft outside top-k has probability 0: never accepted, and the residual never draws it
    b = _batch(2000, 1.0, top_k=2)
    rows = logits[:1].repeat(2000, 1)
    s, a = Sampler(1, torch.device("cpu")).verify(rows, b, torch.full((2000,), 3))
    assert not a.any() and set(s.tolist()) <= {1, 2}
    # a seeded generator per row gives the same decisions again
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    b1, b2 = _batch(2, 1.0), _batch(2, 1.0)
    b1.generators, b2.generators = [g1, g1], [g2, g2]
    r1 = Sampler(0, torch.device("cpu")).verify(logits, b1, torch.tensor([2, -1]))
    r2 = Sampler(7, torch.device("cpu")).verify(logits, b2, torch.tensor([2, -1]))
    assert all(torch.equal(x, y) for x, y in zip(r1, r2))
