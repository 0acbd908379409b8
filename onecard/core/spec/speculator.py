"""The scheduler's side of speculative decoding: asks the drafter for drafts and counts what was accepted.

Contract: ``Speculator(config, drafter=None, policy=None)`` holds one ``Drafter`` (``make_drafter(method, k,
**params)`` from ``onecard.core.spec.drafter`` unless one is given, e.g. a test's) and optionally a ``SpecPolicy``
(core/spec/policy.py: the per-step draft length from acceptance and the verify step's cost; without one, every
proposal is verified in full). ``propose(request, max_k)`` returns
up to ``max_k`` draft token ids to verify after the request's last token (``[]``: a plain decode step);
the number asked is ``min(max_k, num_speculative_tokens)``; ``propose_step([(request, max_k), ...])`` does it
for every decode request of a step (request id -> drafts, only those with some).
``drain_pays([(request, max_k, ahead), ...], extra_tokens)`` is the async loop's switch (core/engine_core.py): with
a step in flight whose samples (``ahead`` tokens per request, 0 or 1) are not known yet, would the next step verify
drafts if that step were resolved first? It proposes from the tokens known now (the stale draft's first ``ahead``
tokens predict the ones in flight; what is left is what a fresh draft would likely verify) and asks the policy's
side-effect-free ``peek``; when that says no, ``choose`` runs on the same drafts, so the policy's evidence fades
for sequences held at k = 0 exactly as in a step of the synchronous loop. Without a policy: any stale draft
longer than ``ahead``. The drafters' calls stay append-only (the fresh proposal extends the stale one's tokens).
``observe(request, num_tokens)`` passes the
drafter a prefill chunk's tokens (its early indexing); ``finish(request, aborted)`` ends the drafter's state
for a request that ended (``tokens=None`` when aborted). ``record(request, num_drafts, num_accepted)`` counts one
verify step of one sequence (and tells the policy) into vLLM's spec-decode metrics (``stats()``): drafts (sequences verified with at
least one draft), draft tokens, accepted tokens and accepted tokens per draft position.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from onecard.config import SpeculativeConfig
from onecard.core.request import Request
from onecard.core.spec.policy import SpecPolicy

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SpecStats:
    """Cumulative counters (vLLM's ``vllm:spec_decode_*``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]: steps whose draft at position i was accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter=None, policy: SpecPolicy | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        if drafter is None:
            from onecard.core.spec.drafter import make_drafter

            drafter = make_drafter(config.method, config.num_speculative_tokens, **config.params)
        self.drafter = drafter
        self.policy = policy
        self.counts = SpecStats(accepted_per_pos=[0] * self.k)

    def propose(self, request: Request, max_k: int) -> list[int]:
        k = min(max_k, self.k)
        if k <= 0:
            return []
        drafts = self.drafter.propose(request.request_id, request.all_token_ids, k)
        return list(drafts[:k]) if drafts else []

    def propose_step(self, candidates: list[tuple[Request, int]], extra_tokens: int = 0) -> dict[str, list[int]]:
        """Drafts for one step's decode requests, given as (request, the most drafts it may take; 0 for none):
        request id -> drafts (requests with none are left out). Without a policy every request verifies what the
        drafter proposes, up to k = num_speculative_tokens; with one, ``policy.choose`` cuts each proposal to the
        length worth verifying in this step (``extra_tokens``: the step's prefill tokens, for its cost)."""
        out: dict[str, list[int]] = {}
        for req, max_k in candidates:
            d = self.propose(req, max_k)
            if d or self.policy is not None:
                out[req.request_id] = d
        if self.policy is not None and out:
            ctx = {req.request_id: req.num_computed_tokens for req, _ in candidates}
            ks = self.policy.choose(out, ctx, extra_tokens)
            out = {rid: d[:ks.get(rid, 0)] for rid, d in out.items() if ks.get(rid, 0) > 0}
        return out

    def drain_pays(self, candidates: list[tuple[Request, int, int]], extra_tokens: int = 0) -> bool:
        drafts: dict[str, list[int]] = {}
        for req, max_k, ahead in candidates:
            if ahead and req.num_preemptions and not req.output_token_ids:
                continue        # (a drafter that finds the prompt's end at its first proposal would misplace it)
            d = self.propose(req, max_k + ahead)[ahead:] if max_k > 0 else []
            if d or self.policy is not None:
                drafts[req.request_id] = d
        if self.policy is None or not any(drafts.values()):
            return any(drafts.values())
        ctx = {req.request_id: req.num_computed_tokens for req, _, _ in candidates}
        # a plain answer keeps choose's per-step update (this step stays plain); a drafting one is put back: the
        # step is scheduled with fresh drafts after the drain, and choose runs on those
        return any(self.policy.peek(drafts, ctx, extra_tokens, keep_plain=True).values())

    def preempted(self, request: Request) -> None:
        if self.policy is not None:
            self.policy.forget(request.request_id)

    def observe(self, request: Request, num_tokens: int) -> None:
        if request.num_preemptions:
            return                  # recomputing tokens the drafter has seen (its calls are append-only)
        toks = request.all_token_ids
        self.drafter.observe(request.request_id, toks if num_tokens >= len(toks) else toks[:num_tokens])

    def finish(self, request: Request, aborted: bool) -> None:
        if self.policy is not None:
            self.policy.forget(request.request_id)
        try:
            self.drafter.finish(request.request_id, None if aborted else request.all_token_ids)
        except Exception:  # a drafter's bookkeeping must never fail a request
            logger.exception("drafter.finish failed for %s", request.request_id)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        if self.policy is not None:
            self.policy.record(request.request_id, num_drafts, num_accepted)
        c = self.counts
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        per = c.accepted_per_pos
        for i in range(num_accepted):
            per[i] += 1

    def stats(self) -> SpecStats:
        c = self.counts
        return SpecStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos))
