"""Sampling on the device: penalties, temperature, top-k, top-p, min-p, seeded per-request draws.

Contract: ``Sampler.sample(logits[B, V] fp32, batch: SamplingBatch) -> SamplerResult``. Greedy rows take the
argmax of the penalised logits. Random rows draw with the exponential-race trick (argmax p / q, q ~ Exp(1)),
which needs no host sync and lets a seeded request use its own ``torch.Generator`` so its samples do not
depend on what else is in the batch. Logprobs are vLLM's default "raw" logprobs (log_softmax of the model's
logits before any processing). The only host sync is the final ``.tolist()`` in the runner.
``Sampler.verify`` accepts or rejects speculative drafts against the same per-position distributions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor | None    # [B] fp32; 0 = greedy (None when all_greedy)
    top_p: torch.Tensor | None          # [B] fp32
    top_k: torch.Tensor | None          # [B] int64; 0 = off (vocab)
    min_p: torch.Tensor | None          # [B] fp32
    all_greedy: bool
    any_top_p_k: bool
    any_min_p: bool
    generators: list[torch.Generator | None]     # per row; None = the engine's shared generator
    # Penalties (None when no row uses any): counts of output tokens and a mask of prompt+output tokens.
    presence: torch.Tensor | None = None         # [B] fp32
    frequency: torch.Tensor | None = None        # [B] fp32
    repetition: torch.Tensor | None = None       # [B] fp32
    output_counts: torch.Tensor | None = None    # [B, V] fp32
    seen_mask: torch.Tensor | None = None        # [B, V] bool (prompt or output)
    banned: list[list[int]] | None = None        # per row: stop ids masked until min_tokens


@dataclass(slots=True)
class SamplerResult:
    token_ids: torch.Tensor                  # [B] int64
    logprobs: torch.Tensor | None = None     # [B] fp32: sampled token's raw logprob
    ranks: torch.Tensor | None = None        # [B] int64
    top_ids: torch.Tensor | None = None      # [B, N]
    top_logprobs: torch.Tensor | None = None # [B, N]


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @staticmethod
    def _processed(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """fp32 logits [R, V] with the batch's banned ids at -inf and its penalties applied (both paths)."""
        logits = logits.float()
        if b.banned is not None:
            logits = logits.clone()
            for row, ids in enumerate(b.banned):
                if ids:
                    logits[row, ids] = float("-inf")
        if b.seen_mask is not None:
            logits = apply_penalties(logits, b)
        return logits

    def sample(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerResult:
        logits = self._processed(logits, b)
        if b.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._random(logits, b)

        return SamplerResult(token_ids=tokens)

    def _random(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)                                   # [B]
        probs = _probs(logits, b)                                        # [B, V] (not normalised under min-p)
        q = torch.empty_like(probs)
        if all(g is None for g in b.generators):
            q.exponential_(generator=self.generator)
        else:
            for row, g in enumerate(b.generators):
                q[row].exponential_(generator=g or self.generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(b.temperature < 1e-5, greedy, sampled)

    def verify(self, logits: torch.Tensor, b: SamplingBatch, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding: row r holds the logits at a position whose draft is ``drafts[r]`` (-1: none, the
        position after the last draft). Returns (sample[R], accept[R] bool). Greedy rows: accept = the argmax is
        the draft, sample = the argmax. Random rows (exact rejection sampling with a point proposal q = 1[draft]):
        accept with probability p(draft); sample from p with the draft removed and renormalised (the residual
        max(p - q, 0)) on a draft row, from p on a row without one. p is what ``sample`` would draw from at that
        position (bans, penalties, temperature, top-k/top-p/min-p applied by the caller's batch). Seeded rows
        draw from their own generator: the exponentials first, then the uniform of a draft row."""
        logits = self._processed(logits, b)
        greedy = logits.argmax(dim=-1)                                   # [R]
        has_draft = drafts >= 0
        if b.all_greedy:
            return greedy, has_draft & (greedy == drafts)
        probs = _probs(logits, b)
        probs = probs / probs.sum(dim=-1, keepdim=True)                  # [R, V] normalised (min-p zeroes some)
        safe = drafts.clamp(min=0).unsqueeze(1)                          # [R, 1]
        p_draft = probs.gather(1, safe).squeeze(1)                       # [R]
        residual = probs.scatter(1, safe, torch.where(has_draft.unsqueeze(1), 0.0, p_draft.unsqueeze(1)))
        q = torch.empty_like(probs)
        u = torch.ones_like(p_draft)                                     # 1.0: never accepted (no draft)
        if all(g is None for g in b.generators):
            q.exponential_(generator=self.generator)
            u = torch.where(has_draft, torch.rand(u.shape, generator=self.generator, device=u.device), u)
        else:
            has = has_draft.tolist()
            for row, g in enumerate(b.generators):
                g = g or self.generator
                q[row].exponential_(generator=g)
                if has[row]:
                    u[row] = torch.rand((), generator=g, device=u.device)
        sampled = (residual / q).argmax(dim=-1)
        accepted = has_draft & (u < p_draft)
        is_greedy = b.temperature < 1e-5
        return (torch.where(is_greedy, greedy, sampled),
                torch.where(is_greedy, has_draft & (greedy == drafts), accepted))


def _probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The distribution a random row draws from: temperature, top-k/top-p, softmax, min-p (zeroed, not
    renormalised: the exponential race does not need it)."""
    temp = torch.where(b.temperature < 1e-5, torch.ones_like(b.temperature), b.temperature)
    logits = logits / temp.unsqueeze(1)
    if b.any_top_p_k:
        logits = apply_top_k_top_p(logits, b.top_k, b.top_p)
    probs = torch.softmax(logits, dim=-1)                                # [B, V]
    if b.any_min_p:
        top = probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < b.min_p.unsqueeze(1) * top, torch.zeros_like(probs), probs)
    return probs


def compute_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, n: int) -> SamplerResult:
    """Raw logprobs of the sampled tokens, their ranks, and the top-n alternatives."""
    lp = torch.log_softmax(raw_logits.float(), dim=-1)                    # [B, V]
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)                  # [B]
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    res = SamplerResult(token_ids=tokens, logprobs=chosen, ranks=ranks)
    if n > 0:
        top_lp, top_ids = lp.topk(n, dim=-1)
        res.top_ids, res.top_logprobs = top_ids, top_lp
    return res


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    # vLLM semantics: repetition over prompt+output tokens (divide positive, multiply negative logits);
    # presence/frequency over output tokens only (OpenAI's formula).
    rep = b.repetition.unsqueeze(1)                                       # [B, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(b.seen_mask, penalised, logits)
    counts = b.output_counts
    logits = logits - b.frequency.unsqueeze(1) * counts
    logits = logits - b.presence.unsqueeze(1) * (counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus top-p (sort-based; no host sync)."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)     # ascending
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))              # [B, 1] k-th largest
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop = cum <= (1 - top_p.unsqueeze(1))
    drop[:, -1] = False                                                  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
