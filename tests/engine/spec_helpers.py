"""Test-only drafters and helpers for speculative decoding tests (the real drafters live in core/spec/)."""
from __future__ import annotations

import time
from collections.abc import Sequence

from onecard.config import SpeculativeConfig
from onecard.core.spec.speculator import Speculator
from onecard.protocol import EngineRequest


class OracleDrafter:
    """Proposes the true continuation of a request (from a non-speculative run), with every ``corrupt_every``-th
    draft position (counted over absolute positions) changed to another token: both acceptance and rejection
    happen, deterministically. Where the request left the reference, it proposes the last token repeated."""

    def __init__(self, reference: dict[str, list[int]], vocab: int, corrupt_every: int = 3) -> None:
        self.reference = reference
        self.vocab = vocab
        self.corrupt_every = corrupt_every
        self.proposed = 0
        self.observed: dict[str, int] = {}
        self.finished: dict[str, bool] = {}     # request id -> aborted

    def propose(self, req_id: str, tokens: Sequence[int], max_k: int) -> list[int]:
        n = len(tokens)
        ref = self.reference.get(req_id)
        if ref is None:                          # (requests named by the LLM class: find one by its tokens)
            ref = next((r for r in self.reference.values() if list(r[:n]) == list(tokens)), None)
        if ref is not None and list(ref[:n]) == list(tokens):
            out = list(ref[n:n + max_k])
        else:
            out = [tokens[-1]] * max_k
        if self.corrupt_every:
            out = [(t + 1) % self.vocab if (n + i) % self.corrupt_every == 0 else t for i, t in enumerate(out)]
        self.proposed += len(out)
        return out

    def observe(self, req_id: str, tokens: Sequence[int]) -> None:
        self.observed[req_id] = len(tokens)

    def finish(self, req_id: str, tokens: Sequence[int] | None) -> None:
        self.finished[req_id] = tokens is None


def enable_spec(core, drafter, k: int = 4) -> Speculator:
    """Turn speculation on in an EngineCore (what ``speculative_config`` does, with a test drafter)."""
    spec = Speculator(SpeculativeConfig("ngram", k), drafter)
    core.scheduler.speculator = spec
    return spec


def run(core, requests: dict[str, tuple[list[int], object]]) -> dict[str, dict]:
    for rid, (prompt, sp) in requests.items():
        assert core.add_request(EngineRequest(rid, list(prompt), sp, time.monotonic(), [])) is None
    got: dict[str, dict] = {rid: {"tokens": [], "logprobs": [], "finish": None, "outputs": 0} for rid in requests}
    while core.has_unfinished():
        for o in core.step():
            g = got[o.request_id]
            g["tokens"] += o.new_token_ids
            g["outputs"] += 1
            g["logprobs"] += [(lp.token_id, lp.rank, lp.logprob, sorted(lp.top)) for lp in (o.new_logprobs or [])]
            if o.finish_reason is not None:
                g["finish"] = (o.finish_reason, o.stop_reason)
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks          # nothing leaked
    return got


def to_verify_step(core):
    """Step the engine until its next schedule carries drafts; -> that SchedulerOutput (not executed)."""
    for _ in range(40):
        sched = core.scheduler.schedule()
        if any(s.draft_token_ids for s in sched.scheduled) and all(s.samples for s in sched.scheduled) \
                and all(s.draft_token_ids or s.num_new_tokens == 1 for s in sched.scheduled):
            return sched
        core.scheduler.update(sched, core.runner.execute(sched))
    raise AssertionError("no pure verify step came")
