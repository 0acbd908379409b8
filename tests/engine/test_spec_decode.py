"""Speculative decoding in the engine: verified drafts give the outputs of plain decoding.

A test drafter (tests/engine/spec_helpers.py) proposes each request's true continuation from a plain run with
every third position corrupted, so steps accept some drafts and reject others, deterministically. Greedy
outputs, stop ids, min_tokens, penalties and logprobs must equal the plain engine's token for token on the tiny
GPTQ MoE checkpoint (the real quantized path; the plain engine is itself checked against HF transformers in
test_engine_vs_hf.py), with small budgets, chunked prefill and preemption too; KV blocks never leak and the
prefix cache registers only blocks of accepted tokens. Seeded random sampling is reproducible.
"""
from __future__ import annotations

import pytest

from onecard.config import SpeculativeConfig
from onecard.sampling_params import SamplingParams
from tests.engine.spec_helpers import OracleDrafter, assert_same_outputs, enable_spec, run
from tests.engine.spec_helpers import make_core as _core
from tests.engine.spec_helpers import spec_prompts as _prompts


@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8,
                                        "enable_prefix_caching": False}, {"num_gpu_blocks_override": 14}])
def test_greedy_matches_plain_decoding(tiny_moe_gptq_dir, plain, extra):
    reqs, want, ref, vocab = plain
    core = _core(tiny_moe_gptq_dir, **extra)
    drafter = OracleDrafter(ref, vocab)
    spec = enable_spec(core, drafter, k=4)
    got = run(core, reqs)
    assert_same_outputs(got, want)
    # the stops really cut outputs short (inside a verify step), min_tokens held its stop ids back
    assert len(want["stop_id"]["tokens"]) == 7 and len(want["min_tok"]["tokens"]) == 8
    assert len(want["max5"]["tokens"]) == 5 and len(want["lp"]["logprobs"]) == 15
    st = spec.stats()
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens          # both paths ran
    assert st.accepted_per_pos[0] >= st.accepted_per_pos[1] > 0
    assert sum(g["outputs"] for g in got.values()) < sum(len(g["tokens"]) for g in got.values())
    assert set(drafter.finished) == set(reqs) and not any(drafter.finished.values())   # finish(), not aborted
    if "num_gpu_blocks_override" in extra:
        assert core.stats().num_preemptions > 0
    s = core.stats()
    assert (s.spec_num_drafts, s.spec_num_accepted_tokens) == (st.num_drafts, st.num_accepted_tokens)


def test_all_drafts_wrong_and_all_right(tiny_moe_gptq_dir, plain):
    reqs, want, ref, vocab = plain
    reqs = {r: reqs[r] for r in ("g1", "g4", "pen", "max5")}
    for corrupt, accepted in ((1, False), (0, True)):
        core = _core(tiny_moe_gptq_dir)
        spec = enable_spec(core, OracleDrafter(ref, vocab, corrupt_every=corrupt), k=3)
        got = run(core, reqs)
        assert all(got[r]["tokens"] == want[r]["tokens"] for r in reqs)
        st = spec.stats()
        if accepted:   # the true continuation: every draft accepted (and a bonus token each step)
            assert st.num_accepted_tokens == st.num_draft_tokens > 0
        else:
            assert st.num_accepted_tokens == 0 and st.num_draft_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_cache_holds_only_accepted_tokens(tiny_moe_gptq_dir, plain, async_scheduling):
    _, _, ref, vocab = plain
    core = _core(tiny_moe_gptq_dir, block_size=8, async_scheduling=async_scheduling)   # (async: the hybrid loop)
    spec = enable_spec(core, OracleDrafter(ref, vocab, corrupt_every=2), k=5)
    sp = SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True)
    prompt = _prompts()[4]
    got = run(core, {"a": (prompt, sp)})
    assert 0 < spec.stats().num_accepted_tokens < spec.stats().num_draft_tokens
    kv = core.scheduler.kv_cache_manager
    tokens = prompt + got["a"]["tokens"]
    assert tokens[:len(ref["g4"])] == ref["g4"]             # (the plain run's 18 tokens)
    cached = {b.token_ids for b in kv.blocks if b.block_hash is not None}
    full = {tuple(tokens[i:i + 8]) for i in range(0, len(tokens) - 7, 8)}
    assert cached and cached <= full              # every cached block holds accepted tokens at a block boundary
    # and a second request with that sequence as its prompt hits them, giving the same continuation
    again = run(core, {"b": (tokens[:-1], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))})
    assert again["b"]["tokens"] == [tokens[-1]]
    assert core.stats().prefix_cache_hits >= (len(tokens) - 1) // 8 * 8 - 8


def test_abort_mid_draft_leaks_nothing(tiny_moe_gptq_dir, plain):
    import time

    from onecard.protocol import EngineRequest

    reqs, _, ref, vocab = plain
    core = _core(tiny_moe_gptq_dir)
    drafter = OracleDrafter(ref, vocab)
    enable_spec(core, drafter, k=4)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for rid in ("g0", "g1", "g4"):
        core.add_request(EngineRequest(rid, reqs[rid][0], sp, time.monotonic(), []))
    for _ in range(4):
        core.step()
    assert any(s.draft_token_ids for s in core.scheduler.schedule().scheduled)   # a verify step is scheduled
    core.abort(["g0", "g1", "g4"])      # (its blocks, drafts included, are freed with the request)
    while core.has_unfinished():
        core.step()
    core.step()
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert drafter.finished == {"g0": True, "g1": True, "g4": True}
    assert not core.runner.block_tables and not core.runner.states


def test_seeded_sampling_is_reproducible(tiny_moe_gptq_dir, plain):
    vocab = plain[3]
    p = _prompts()
    sps = {"s1": (p[0], SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=10,
                                       ignore_eos=True)),
           "s2": (p[4], SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=10, ignore_eos=True,
                                       frequency_penalty=0.5, logprobs=1))}
    ref = {"s1": p[0] + run(_core(tiny_moe_gptq_dir), sps)["s1"]["tokens"], "s2": p[4] * 2}
    outs = []
    for _ in range(2):
        core = _core(tiny_moe_gptq_dir)
        spec = enable_spec(core, OracleDrafter(ref, vocab, corrupt_every=4), k=3)
        outs.append(run(core, sps))
        assert spec.stats().num_draft_tokens > 0
    assert outs[0] == outs[1]
    assert all(len(outs[0][r]["tokens"]) == 10 for r in sps)
    assert len(outs[0]["s2"]["logprobs"]) == 10


def test_with_the_draft_length_policy(tiny_moe_gptq_dir, plain):
    """The GPU path's per-step policy (an H200's cost model here) cuts drafts; outputs stay the plain ones and
    the policy forgets every request at its end (preemptions included)."""
    from onecard.core.spec.cost import CostModel
    from onecard.core.spec.policy import SpecPolicy
    from onecard.core.spec.speculator import Speculator

    reqs, want, ref, vocab = plain
    core = _core(tiny_moe_gptq_dir, num_gpu_blocks_override=14)
    policy = SpecPolicy(4, CostModel.for_engine(core.config, "NVIDIA H200"), prior_acceptance=0.9)
    spec = Speculator(SpeculativeConfig("ngram", 4), OracleDrafter(ref, vocab, corrupt_every=5), policy)
    core.scheduler.speculator = spec
    got = run(core, reqs)
    assert all(got[r]["tokens"] == want[r]["tokens"] for r in reqs)
    assert spec.stats().num_accepted_tokens > 0 and policy.last is not None
    assert policy.tracked() == 0
