"""Speculative decoding with async scheduling: the hybrid loop of core/engine_core.py.

Plain steps pipeline (one step in flight, its samples fed to the next step on the device); a step that carries
drafts is proposed from fully known tokens and resolved (result + update) before anything else is scheduled;
before scheduling on top of a step in flight, the speculator's stale proposal and the policy's side-effect-free
``peek`` decide whether to drain it for a verify step. Checked here on the CPU with async scheduling forced on,
against the plain engine (synchronous loop, no speculation; itself checked against HF transformers): greedy
outputs, stops, min_tokens, penalties and logprobs token for token, with an oracle drafter (accepts and
rejects), with small budgets, chunked prefill and preemption; no KV block, runner state or policy evidence
leaks after rejections, preemption and aborts mid-flight (the prefix cache: test_spec_decode.py). What the
loop did is observed through the scheduler and the runner (``LoopLog``), never through timing: verify steps are
submitted with nothing in flight and updated before the next schedule; when no drafts would pay (a drafter with
nothing, a policy that says no) the submits pipeline exactly as the plain async engine's do.
"""
from __future__ import annotations

import time

import pytest

from onecard.config import SpeculativeConfig
from onecard.core.spec.cost import CostModel
from onecard.core.spec.policy import SpecPolicy
from onecard.core.spec.speculator import Speculator
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams
from tests.engine.spec_helpers import (
    OracleDrafter,
    assert_same_outputs,
    enable_spec,
    make_core,
    run,
)


class LoopLog:
    """Records what an engine's loop does, seen from its scheduler and runner: for each submitted step, how many
    submitted steps were not yet updated (in flight) and whether it carries drafts; and every ``schedule()`` call
    made while a verify step was not yet updated (must never happen)."""

    def __init__(self, core) -> None:
        self.submits: list[tuple[int, bool]] = []
        self.unresolved_verify_at_schedule = 0
        self._open: list = []                        # steps submitted, not yet updated
        sched, runner = core.scheduler, core.runner
        schedule, update, submit = sched.schedule, sched.update, runner.submit

        def logged_schedule(*a, **kw):
            self.unresolved_verify_at_schedule += sum(1 for s in self._open if s.has_drafts)
            return schedule(*a, **kw)

        def logged_update(s, result):
            self._open = [o for o in self._open if o is not s]
            return update(s, result)

        def logged_submit(s, *a, **kw):
            if not s.is_empty:
                carries = any(sr.draft_token_ids for sr in s.scheduled)
                assert carries == s.has_drafts
                self.submits.append((len(self._open), carries))
                self._open.append(s)
            return submit(s, *a, **kw)

        sched.schedule, sched.update, runner.submit = logged_schedule, logged_update, logged_submit

    @property
    def pipelined(self) -> int:
        return sum(1 for n, _ in self.submits if n)

    @property
    def verifies(self) -> int:
        return sum(1 for _, d in self.submits if d)

    def check(self) -> None:
        """The hybrid loop's invariants: at most one step in flight; a step with drafts is submitted with none in
        flight; nothing is scheduled on top of an unresolved verify step."""
        assert all(n <= 1 for n, _ in self.submits)
        assert all(n == 0 for n, d in self.submits if d)
        assert self.unresolved_verify_at_schedule == 0


def _async_core(path, **kw):
    core = make_core(path, async_scheduling=True, **kw)
    assert core.async_scheduling
    return core


class _SometimesDrafter(OracleDrafter):
    """The oracle for two requests only, proposing at 4 token counts of every 8: the loop keeps switching between
    pipelined plain steps and drained verify steps."""

    def propose(self, req_id, tokens, max_k):
        if req_id in ("g4", "pen") and len(tokens) % 8 < 4:
            return super().propose(req_id, tokens, max_k)
        return []


@pytest.mark.parametrize("extra, always", [
    ({}, False), ({}, True), ({"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8,
                               "enable_prefix_caching": False}, False), ({"num_gpu_blocks_override": 14}, False)])
def test_hybrid_loop_matches_plain_decoding(tiny_moe_gptq_dir, plain, extra, always):
    reqs, want, ref, vocab = plain
    core = _async_core(tiny_moe_gptq_dir, **extra)
    drafter = OracleDrafter(ref, vocab) if always else _SometimesDrafter(ref, vocab)
    spec = enable_spec(core, drafter, k=4)
    log = LoopLog(core)
    got = run(core, reqs)                 # (run() also checks that every KV block came back)
    assert_same_outputs(got, want)
    log.check()
    assert log.verifies > 0
    if not always:
        assert log.pipelined > 0          # both kinds of step ran
    st = spec.stats()
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert set(drafter.finished) == set(reqs) and not any(drafter.finished.values())
    core.step()                           # the empty step that drops the runner's state of ended requests
    assert not core.runner.block_tables and not core.runner.states and core._in_flight is None
    if "num_gpu_blocks_override" in extra:
        assert core.stats().num_preemptions > 0


class _NoDrafts:
    def propose(self, req_id, tokens, max_k):
        return []

    def observe(self, req_id, tokens):
        pass

    def finish(self, req_id, tokens):
        pass


def _never(core) -> SpecPolicy:
    """A policy that prices every verify step as not worth it (speculation never pays)."""
    return SpecPolicy(4, CostModel.for_engine(core.config, "NVIDIA H200"), min_speedup=1e9)


@pytest.mark.parametrize("case", ["no_drafts", "policy_says_no"])
def test_plain_steps_pipeline_when_no_drafts_would_pay(tiny_moe_gptq_dir, plain, case):
    """The speculative engine submits exactly the steps of the plain async engine, each with the same number in
    flight, when nothing would be verified: speculation costs unrepetitive traffic none of its pipelining."""
    reqs, want, ref, vocab = plain
    base = _async_core(tiny_moe_gptq_dir)
    base_log = LoopLog(base)
    assert_same_outputs(run(base, reqs), want)
    core = _async_core(tiny_moe_gptq_dir)
    drafter = OracleDrafter(ref, vocab, corrupt_every=0)     # every draft right: it would be verified if asked
    policy = None
    if case == "no_drafts":
        drafter = _NoDrafts()
    else:
        policy = _never(core)
    spec = Speculator(SpeculativeConfig("ngram", 4), drafter, policy)
    core.scheduler.speculator = spec
    log = LoopLog(core)
    assert_same_outputs(run(core, reqs), want)
    log.check()
    assert log.submits == base_log.submits and log.pipelined > len(log.submits) // 2
    assert spec.stats().num_draft_tokens == 0
    if policy is not None:
        assert drafter.proposed > 0 and policy.last is not None      # asked every step, said no every time
        assert policy.last.draft_tokens == 0 and policy.tracked() == 0


@pytest.mark.parametrize("corrupt_every", [5, 1])
def test_policy_drains_for_verify_steps(tiny_moe_gptq_dir, plain, corrupt_every):
    """The GPU path's policy (an H200's cost model, a 0.9 prior) on the hybrid loop: it drains the step in flight
    when its peek says a verify pays; with every draft wrong it learns that and the loop pipelines plain steps
    too. Outputs stay the plain ones; it forgets every request (preemptions included)."""
    reqs, want, ref, vocab = plain
    core = _async_core(tiny_moe_gptq_dir, num_gpu_blocks_override=14)
    policy = SpecPolicy(4, CostModel.for_engine(core.config, "NVIDIA H200"), prior_acceptance=0.9)
    spec = Speculator(SpeculativeConfig("ngram", 4), OracleDrafter(ref, vocab, corrupt_every=corrupt_every), policy)
    core.scheduler.speculator = spec
    log = LoopLog(core)
    assert_same_outputs(run(core, reqs), want)
    log.check()
    assert log.verifies > 0 and policy.tracked() == 0
    assert core.stats().num_preemptions > 0
    if corrupt_every == 1:
        assert spec.stats().num_accepted_tokens == 0 and log.pipelined > 0
    else:
        assert spec.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("abort_after", [1, 2, 3, 5, 8])
def test_abort_mid_flight_leaks_nothing(tiny_moe_gptq_dir, plain, abort_after):
    """Aborts between steps, with a plain step in flight or right after a verify step; the other request runs
    on and still gives plain decoding's output."""
    reqs, want, ref, vocab = plain
    core = _async_core(tiny_moe_gptq_dir, num_gpu_blocks_override=14)
    drafter = OracleDrafter(ref, vocab)
    enable_spec(core, drafter, k=4)
    log = LoopLog(core)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    keep_sp = reqs["g3"][1]
    for rid in ("g0", "g1", "g4"):
        core.add_request(EngineRequest(rid, reqs[rid][0], sp, time.monotonic(), []))
    core.add_request(EngineRequest("g3", reqs["g3"][0], keep_sp, time.monotonic(), []))
    kept: list[int] = []
    for _ in range(abort_after):
        kept += [t for o in core.step() if o.request_id == "g3" for t in o.new_token_ids]
    aborted = core.abort(["g0", "g1", "g4"])
    assert {o.request_id for o in aborted} == {"g0", "g1", "g4"}
    while core.has_unfinished():
        kept += [t for o in core.step() if o.request_id == "g3" for t in o.new_token_ids]
    core.step()                                   # the empty step that drops the runner's state of ended requests
    log.check()
    assert kept == want["g3"]["tokens"]
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert drafter.finished == {"g0": True, "g1": True, "g4": True, "g3": False}
    assert not core.runner.block_tables and not core.runner.states and core._in_flight is None
