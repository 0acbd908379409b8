"""Test-only drafters and helpers for speculative decoding tests (the real drafters live in core/spec/)."""
from __future__ import annotations

import time
from collections.abc import Sequence

from onecard.config import EngineArgs, SpeculativeConfig
from onecard.core.engine_core import EngineCore
from onecard.core.spec.speculator import Speculator
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams


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


def assert_same_outputs(got: dict, want: dict) -> None:
    """``run()`` results equal request by request: tokens, finish, logprobs (values within 1e-4)."""
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        assert got[rid]["finish"] == want[rid]["finish"], rid
        a, b = got[rid]["logprobs"], want[rid]["logprobs"]
        assert [(t, r, top) for t, r, _, top in a] == [(t, r, top) for t, r, _, top in b], rid
        assert all(abs(x[2] - y[2]) < 1e-4 for x, y in zip(a, b)), rid


def make_core(path, **kw) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device="cpu", max_model_len=192, **kw).create_config())


def spec_prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    rand = [torch.randint(3, 200, (int(k),), generator=g).tolist() for k in (5, 12, 30, 47)]
    rep = [[11, 12, 13, 14] * 6, [40, 41] * 15 + [42]]        # repetitive (a drafter's easy case)
    return rand + rep


def spec_requests(prompts, greedy_tokens=None, vocab=None) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    reqs = {f"g{i}": (p, sp) for i, p in enumerate(prompts)}
    reqs["lp"] = (prompts[0], SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, logprobs=2))
    reqs["pen"] = (prompts[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
                                              frequency_penalty=1.0, repetition_penalty=1.8))
    reqs["max5"] = (prompts[2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))  # inside a draft
    if greedy_tokens is not None:
        reqs["stop_id"] = (prompts[3], SamplingParams(temperature=0.0, max_tokens=18,
                                                      stop_token_ids=[greedy_tokens["g3"][6]]))
        # every id but 0-2 stops it, and is banned until min_tokens outputs exist: it stops right after them
        reqs["min_tok"] = (prompts[4], SamplingParams(temperature=0.0, max_tokens=18, min_tokens=7,
                                                      stop_token_ids=list(range(3, vocab))))
    return reqs


def plain_reference(path) -> tuple[dict, dict, dict, int]:
    """Outputs of plain decoding (synchronous loop, no speculation) of ``spec_requests``, and the reference
    continuations an ``OracleDrafter`` proposes from: (requests, outputs, references, vocab)."""
    core = make_core(path)
    vocab = int(core.config.model.hf_config["vocab_size"])
    prompts = spec_prompts()
    first = run(core, spec_requests(prompts))
    greedy = {rid: g["tokens"] for rid, g in first.items()}
    reqs = spec_requests(prompts, greedy, vocab)
    got = run(core, reqs)
    ref = {rid: list(reqs[rid][0]) + got[rid]["tokens"] for rid in reqs}
    return reqs, got, ref, vocab


def to_verify_step(core):
    """Step the engine until its next schedule carries drafts; -> that SchedulerOutput (not executed)."""
    for _ in range(40):
        sched = core.scheduler.schedule()
        if any(s.draft_token_ids for s in sched.scheduled) and all(s.samples for s in sched.scheduled) \
                and all(s.draft_token_ids or s.num_new_tokens == 1 for s in sched.scheduled):
            return sched
        core.scheduler.update(sched, core.runner.execute(sched))
    raise AssertionError("no pure verify step came")


def eager_and_graphed(runner, graphs, inputs, b: int, q: int):
    """One verify step run eagerly (the runner without graphs), then, from the same KV, replayed through
    ``graphs``' (b, q) shape, which must serve it exactly once: (eager logits, graphed logits, the KV before the
    step, the KV the eager step left); the KV ends as the replay left it."""
    snapshot = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    saved, runner.graphs = runner.graphs, None
    eager = runner.model.compute_logits(runner._forward(inputs))
    kv_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.graphs = saved
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        k.copy_(k0)
        v.copy_(v0)
    before = graphs.replays[(b, q)]
    hidden = graphs.try_run(inputs)
    assert hidden is not None and hidden.shape[0] == inputs.input_ids.shape[0]
    assert graphs.replays[(b, q)] == before + 1
    return eager, runner.model.compute_logits(hidden), snapshot, kv_eager


def verify_step_inputs(core, prompts: list[list[int]]):
    """Requests for ``prompts`` with oracle drafts (k = 4; request 1's max_tokens leaves room for one draft
    only), stepped until a pure verify step comes: (its ModelInputs, q = 1 + its longest draft), some of its
    sequences shorter than q (asserted: the padded layout has pad rows)."""
    import numpy as np

    from onecard.runner.cuda_graphs import verify_query_len
    from onecard.runner.input_batch import build_inputs

    vocab = int(core.config.model.hf_config["vocab_size"])
    ref = {f"r{i}": list(p) + [(7 * j + i) % vocab for j in range(40)] for i, p in enumerate(prompts)}
    enable_spec(core, OracleDrafter(ref, vocab), k=4)
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=3 if i == 1 else 30, ignore_eos=True)
        core.add_request(EngineRequest(f"r{i}", p, sp, 0.0, []))
    inputs = build_inputs(to_verify_step(core), core.runner.block_size, {}, None)
    q = verify_query_len(inputs)
    assert q is not None and np.diff(inputs.query_start_loc).min() < q
    return inputs, q
