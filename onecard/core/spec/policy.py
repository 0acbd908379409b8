"""Adaptive draft length: per step, how many of each sequence's draft tokens to verify (process B, pure Python).

Contract (the engine's side, all of it):
  ``policy = SpecPolicy(num_speculative_tokens, cost)``  (``cost``: a ``CostModel``, onecard/core/spec/cost.py)
  ``policy.choose(drafts, context_lens=None, extra_tokens=0) -> dict[req_id, int]``: ``drafts`` maps EVERY decode
      sequence of the step to its drafter proposal (a token list, or its length; empty / 0 when the drafter has
      nothing); the answer maps each to k in 0..min(num_speculative_tokens, len(draft)): verify the first k
      draft tokens. ``context_lens`` (tokens already in each sequence's KV) and ``extra_tokens`` (prefill-chunk
      tokens in the same step) refine the cost; both optional. All k = 0 means: run a plain decode step.
  ``policy.record(req_id, proposed, accepted)`` after verification: ``proposed`` = the k verified, ``accepted`` =
      how many of them matched (0..proposed). ``policy.forget(req_id)`` when the request ends or is preempted.
  ``policy.peek(drafts, context_lens=None, extra_tokens=0) -> dict[req_id, int]``: what ``choose`` would answer
      now, with no effect on the policy's state (no idle fading, ``last`` untouched): the async engine loop asks
      it whether draining the step in flight for a verify step would pay (core/engine_core.py).
  ``policy.acceptance(req_id) -> float``: the per-token acceptance estimate in use; ``policy.last``: the last
      step's ``StepDecision`` (for logs and benches). Deterministic: no clocks, no randomness.

Model. A draft token i is accepted with probability α (the sequence's estimate) given all before it were, so
verifying k tokens emits E(k) = (1 − α^(k+1)) / (1 − α) tokens (the accepted ones + the target's own token;
``expected_tokens``), and the j-th draft token adds α^j. The step's cost is T(B, B + Σk_i + extra) from the
cost model. For each total m of draft tokens the best split takes the m largest marginal gains α_i^j (each
sequence's gains fall with j, so these are prefixes: the split is optimal for m); the policy picks the m that
maximises (B + Σ gains) / T(B, B + m + extra), and turns speculation off for the whole step (m = 0) unless that
beats the plain step's B / T(B, B + extra) by ``min_speedup`` (margin for the model's error).
Where the engine replays verify steps from padded CUDA graphs (``cost.pads_verify(B)``, no prefill tokens in the
step) a step costs T(B, B·(1 + max k_i)) whatever the other k_i: the policy then picks the best common cap c over
the batch (k_i = min(c, cap_i); ``_choose_padded``), which is the optimum of that cost over all k vectors.
Acceptance estimate: each record adds ``accepted`` successes in ``accepted + (accepted < proposed)`` trials (a
truncated geometric: the first rejection ends the draft), decayed by ``decay`` per trial, and shrunk toward a
prior with ``prior_weight`` pseudo-trials: α = (s + w·p) / (t + w). The prior p of a request is the running
acceptance over all requests (itself shrunk toward ``prior_acceptance``), so new requests start where traffic
is. A sequence left at k = 0 while it had a draft forgets its evidence by ``idle_decay`` per step, drifting back
to the prior so that it is probed again when the text turns repetitive.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from onecard.core.spec.cost import CostModel

CONTEXT_ROUND = 64            # contexts rounded for the cost model's cache (KV term: ~0.1% at 512 tokens)
MAX_ALPHA = 0.999


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits for a k-token draft with per-token acceptance α: Σ_{j=0..k} α^j."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(slots=True)
class _Evidence:
    successes: float = 0.0
    trials: float = 0.0

    def add(self, accepted: int, trials: int, decay: float) -> None:
        f = decay ** trials
        self.successes = self.successes * f + accepted
        self.trials = self.trials * f + trials

    def fade(self, factor: float) -> None:
        self.successes *= factor
        self.trials *= factor

    def estimate(self, prior: float, weight: float) -> float:
        return (self.successes + weight * prior) / (self.trials + weight)


@dataclass(slots=True)
class StepDecision:
    ks: dict[str, int]
    batch: int
    draft_tokens: int               # Σ k_i
    expected_emitted: float         # Σ E_i(k_i)
    step_time_s: float              # T(B, B + Σk + extra), model
    plain_step_time_s: float        # T(B, B + extra), model
    speedup: float                  # (emitted / T) / (B / T_plain); 1.0 when off


@dataclass(slots=True)
class SpecPolicy:
    num_speculative_tokens: int
    cost: CostModel
    prior_acceptance: float = 0.5
    prior_weight: float = 4.0        # pseudo-trials of the prior in each request's estimate
    decay: float = 0.92              # per trial: evidence half-life ~8 draft tokens
    global_decay: float = 0.995      # per trial, all requests together (half-life ~140)
    idle_decay: float = 0.95         # per step a sequence with a draft is held at k = 0
    global_idle_decay: float = 0.99  # per step the whole batch is held at k = 0 though drafts were there
    min_speedup: float = 1.03
    _seqs: dict[str, _Evidence] = field(default_factory=dict)
    _global: _Evidence = field(default_factory=_Evidence)
    last: StepDecision | None = None
    _times: dict[tuple[int, int, int], list[float]] = field(default_factory=dict)
    _monotone: dict[tuple[int, int, int], bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, not {self.num_speculative_tokens}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], not {self.prior_acceptance}")

    # ---------------------------------------------------------------- acceptance bookkeeping
    def global_acceptance(self) -> float:
        return min(MAX_ALPHA, self._global.estimate(self.prior_acceptance, self.prior_weight))

    def acceptance(self, req_id: str, prior: float | None = None) -> float:
        """The per-token acceptance estimate of a request (``prior``: the global one, when the caller has it)."""
        g = self.global_acceptance() if prior is None else prior
        ev = self._seqs.get(req_id)
        return g if ev is None else min(MAX_ALPHA, ev.estimate(g, self.prior_weight))

    def record(self, req_id: str, proposed: int, accepted: int) -> None:
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted ({accepted}) must be within 0..proposed ({proposed})")
        if proposed == 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        self._seqs.setdefault(req_id, _Evidence()).add(accepted, trials, self.decay)
        self._global.add(accepted, trials, self.global_decay)

    def forget(self, req_id: str) -> None:
        self._seqs.pop(req_id, None)

    def tracked(self) -> int:
        """Requests with evidence held (for leak checks)."""
        return len(self._seqs)

    # ---------------------------------------------------------------- the per-step choice
    def choose(self, drafts: Mapping[str, Sequence[int] | int], context_lens: Mapping[str, int] | None = None,
               extra_tokens: int = 0) -> dict[str, int]:
        ids = list(drafts)
        batch = len(ids)
        ks = dict.fromkeys(ids, 0)
        if batch == 0:
            self.last = None
            return ks
        caps = [min(self.num_speculative_tokens, d if isinstance(d, int) else len(d)) for d in drafts.values()]
        ctx = 512
        if context_lens:
            mean = sum(context_lens.get(r, 0) for r in ids) / batch
            ctx = max(CONTEXT_ROUND, round(mean / CONTEXT_ROUND) * CONTEXT_ROUND)
        if extra_tokens <= 0 and self.cost.pads_verify(batch):
            return self._choose_padded(ids, caps, ctx)
        base_tokens = batch + max(0, extra_tokens)
        times, monotone = self._step_times(batch, base_tokens, ctx, sum(caps))
        t_plain = times[0]
        # every gain α_i^j in falling order (ties: earlier sequence, then shorter prefix); a sequence's gains
        # fall with j, so any leading run of this list is a set of prefixes
        gains = sorted((-x, i, j) for i, j, x in self._gains(ids, caps))
        total = -sum(x for x, _, _ in gains)
        best_m, best_rate, gained = 0, batch / t_plain, 0.0
        best_emitted, best_t = float(batch), t_plain
        for m, (neg, _, _) in enumerate(gains, start=1):
            gained -= neg
            t = times[m]
            rate = (batch + gained) / t
            if rate > best_rate:
                best_m, best_rate, best_emitted, best_t = m, rate, batch + gained, t
            elif monotone and (batch + total) / t <= best_rate:
                break                            # no later m can win: its time is no less, its gain no more
        speedup = best_rate / (batch / t_plain)
        if best_m == 0 or speedup < self.min_speedup:
            best_m, speedup, best_emitted, best_t = 0, 1.0, float(batch), t_plain
        for _, i, _ in gains[:best_m]:
            ks[ids[i]] += 1
        return self._decided(ks, ids, caps, StepDecision(ks, batch, best_m, best_emitted, best_t, t_plain, speedup))

    def _gains(self, ids: list[str], caps: list[int]):
        """(sequence index i, position j, α_i^j) for j = 1..cap_i of every sequence with a draft, while α_i^j > 0:
        what verifying the j-th draft token of sequence i adds to the tokens the step emits."""
        g = self.global_acceptance()
        for i, (r, c) in enumerate(zip(ids, caps)):
            a, x = self.acceptance(r, g), 1.0
            for j in range(1, c + 1):
                x *= a
                if x <= 0.0:
                    break
                yield i, j, x

    def _decided(self, ks: dict[str, int], ids: list[str], caps: list[int], d: StepDecision) -> dict[str, int]:
        """Fade the evidence of sequences held at k = 0 though they had a draft; keep the decision."""
        for r, c in zip(ids, caps):
            if c > 0 and ks[r] == 0 and r in self._seqs:
                self._seqs[r].fade(self.idle_decay)
        if d.draft_tokens == 0 and any(caps):
            self._global.fade(self.global_idle_decay)
        self.last = d
        return ks

    def peek(self, drafts: Mapping[str, Sequence[int] | int], context_lens: Mapping[str, int] | None = None,
             extra_tokens: int = 0, keep_plain: bool = False) -> dict[str, int]:
        """``choose``'s answer for these drafts, leaving the policy as it was: ``choose`` itself runs (one pricing,
        so the two always agree) and the state it changes (the evidence it fades, ``last``) is put back. The
        memo of step times is a cache, not state. ``keep_plain``: when the answer drafts nothing, keep those
        changes (the per-step update ``choose`` gives a plain step) instead of pricing the step a second time."""
        seqs = {r: (ev.successes, ev.trials) for r in drafts if (ev := self._seqs.get(r)) is not None}
        glob, last = (self._global.successes, self._global.trials), self.last
        ks: dict[str, int] = {}
        try:
            ks = self.choose(drafts, context_lens, extra_tokens)
            return ks
        finally:
            if not (keep_plain and ks and not any(ks.values())):
                for r in drafts:
                    if r in seqs:
                        ev = self._seqs.setdefault(r, _Evidence())
                        ev.successes, ev.trials = seqs[r]
                    else:
                        self._seqs.pop(r, None)
                self._global.successes, self._global.trials = glob
                self.last = last

    def _choose_padded(self, ids: list[str], caps: list[int], ctx: int) -> dict[str, int]:
        """The choice for a step replayed from a padded verify graph: every sequence runs 1 + max k_i rows, so
        the step costs T(B, B·(1 + c)) for the longest draft c, and within that cost each sequence verifies
        min(c, cap_i) tokens (more tokens add gain at no cost). The best common cap c maximises
        (B + Σ_i Σ_{j ≤ min(c, cap_i)} α_i^j) / T(B, B·(1 + c)); a c whose shape has no graph is priced as the
        eager step it would be (T(B, B + Σ_i min(c, cap_i)), the cost model's eager pricing)."""
        batch, cost = len(ids), self.cost
        top = max(caps)
        ks = dict.fromkeys(ids, 0)
        gain = [0.0] * (top + 1)                  # gain[c]: Σ α_i^c over the sequences with cap_i >= c
        drafted = [0] * (top + 1)                 # drafted[c]: how many sequences have cap_i >= c
        for _, j, x in self._gains(ids, caps):
            gain[j] += x
        for c in caps:
            for j in range(1, c + 1):
                drafted[j] += 1
        t_plain = cost.step_time(batch, batch, ctx)
        best_c, best_rate, best_emitted, best_t = 0, batch / t_plain, float(batch), t_plain
        emitted, tokens = float(batch), 0
        for c in range(1, top + 1):
            emitted += gain[c]
            tokens += drafted[c]
            t = cost.padded_step_time(batch, 1 + c, ctx)
            if t is None:
                t = cost.step_time(batch, batch + tokens, ctx)
            if emitted / t > best_rate:
                best_c, best_rate, best_emitted, best_t = c, emitted / t, emitted, t
        speedup = best_rate / (batch / t_plain)
        if best_c == 0 or speedup < self.min_speedup:
            best_c, speedup, best_emitted, best_t = 0, 1.0, float(batch), t_plain
        for r, c in zip(ids, caps):
            ks[r] = min(c, best_c)
        d = StepDecision(ks, batch, sum(ks.values()), best_emitted, best_t, t_plain, speedup)
        return self._decided(ks, ids, caps, d)

    def _step_times(self, batch: int, base_tokens: int, ctx: int, max_draft: int) -> tuple[list[float], bool]:
        """T(batch, base_tokens + m) for m = 0..max_draft, kept per (batch, tokens, context), and whether the row
        never falls: a step's choice is then arithmetic only (its host time is on the GPU's critical path)."""
        key = (batch, base_tokens, ctx)
        row = self._times.get(key)
        if row is None:
            if len(self._times) > 4096:
                self._times.clear()
                self._monotone.clear()
            row = self._times[key] = []
        if len(row) <= max_draft:
            while len(row) <= max_draft:
                row.append(self.cost.step_time(batch, base_tokens + len(row), ctx))
            self._monotone[key] = all(a <= b for a, b in itertools.pairwise(row))
        return row, self._monotone[key]
