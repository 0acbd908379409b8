"""Verification of speculative drafts in a step (process B, torch; synchronous loop).

Contract: ``verify(runner, scheduled, logits_per_sample, logits[R, V]) -> RunnerOutput``. ``scheduled`` are the
step's sampling requests in logit-row order; request i owns ``logits_per_sample[i]`` rows (1 + its k drafts:
the positions of its last token and of each draft). Row j of a request is sampled exactly as a plain decode
step at that position would be, as if the drafts before it had been emitted: penalties and min_tokens count
them, the structured-output grammar has accepted them (``GrammarMasker.masks_spec``), the seeded generator is
the request's own. ``Sampler.verify`` decides each draft (greedy: argmax match; random: exact rejection sampling
with a point proposal, so the output distribution is the plain sampler's). The request gets its longest accepted
draft prefix plus the token sampled at the first rejected position (or the bonus position after the last draft)
in ``verified_token_ids``; requests without drafts in the same step get their one token in ``sampled_token_ids``.
Logprobs (raw, as the plain path: the model's distribution before any processing) are those of each emitted
token at its own position. One host sync for the decisions, a second one only when logprobs are asked for.
"""
from __future__ import annotations

import torch

from onecard.protocol import TokenLogprobs
from onecard.runner.sampler import compute_logprobs
from onecard.runner.step_io import RunnerOutput, ScheduledRequest
from onecard.runner.structured import apply_token_bitmask


def verify(runner, scheduled: list[ScheduledRequest], logits_per_sample: list[int],
           logits: torch.Tensor) -> RunnerOutput:
    reqs = [sr.request for sr in scheduled]
    drafts = [sr.draft_token_ids for sr in scheduled]
    row_reqs, extra, row_drafts = [], [], []
    for r, d, m in zip(reqs, drafts, logits_per_sample):
        d = d or []
        for j in range(m):
            row_reqs.append(r)
            extra.append(d[:j])
            row_drafts.append(d[j] if j < len(d) else -1)
    want = [r.sampling_params.logprobs for r in reqs]
    max_n = max((n for n in want if n is not None), default=None)
    raw_logits = logits                                                     # [R, V] fp32
    errors: dict[str, str] = {}
    if any(r.sampling_params.structured_outputs is not None for r in reqs):
        masked = runner.grammar.masks_spec(reqs, drafts)
        if masked is not None:
            if max_n is not None:
                logits = logits.clone()                  # logprobs stay the model's raw ones (vLLM)
            apply_token_bitmask(logits, *masked)
        errors = runner.grammar.take_errors()
    batch = runner.sampling_batch(row_reqs, logits.shape[-1], extra)
    draft_t = torch.tensor(row_drafts, dtype=torch.int64).to(runner.device)   # [R]
    sample, accept = runner.sampler.verify(logits, batch, draft_t)
    sample_l, accept_l = sample.tolist(), accept.tolist()

    out = RunnerOutput(sampled_token_ids={}, errors=errors)
    emitted: list[tuple[int, list[int], list[int]]] = []     # (request index, rows, tokens) wanting logprobs
    row = 0
    for i, (r, d, m) in enumerate(zip(reqs, drafts, logits_per_sample)):
        if d:
            a = 0
            while a < len(d) and accept_l[row + a]:
                a += 1
            toks = d[:a] + [sample_l[row + a]]
            out.verified_token_ids[r.request_id] = toks
        else:
            toks = [sample_l[row]]
            out.sampled_token_ids[r.request_id] = toks[0]
        if want[i] is not None:
            emitted.append((i, list(range(row, row + len(toks))), toks))
        row += m
    if emitted:
        rows = [x for _, rs, _ in emitted for x in rs]
        toks = [t for _, _, ts in emitted for t in ts]
        idx = torch.tensor(rows, dtype=torch.int64).to(runner.device)
        lp = compute_logprobs(raw_logits.index_select(0, idx), torch.tensor(toks, dtype=torch.int64).to(
            runner.device), max_n)
        chosen, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
        top_ids = lp.top_ids.tolist() if lp.top_ids is not None else None
        top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
        k = 0
        for i, rs, ts in emitted:
            n = want[i]
            items = []
            for t in ts:
                top = dict(zip(top_ids[k][:n], top_lp[k][:n])) if (n and top_ids is not None) else {}
                items.append(TokenLogprobs(t, chosen[k], ranks[k], top))
                k += 1
            rid = reqs[i].request_id
            if drafts[i]:
                out.verified_logprobs[rid] = items
            else:
                out.logprobs[rid] = items[0]
    return out
