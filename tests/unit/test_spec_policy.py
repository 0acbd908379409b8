"""The verify-step cost model and the adaptive draft-length policy (onecard/core/spec/{cost,policy}.py).

References: a seeded Monte-Carlo of random top-k routing for the expert-union formula; the real tensors of the
tiny GPTQ MoE checkpoint for the bytes per weight; run T4's measured H200 step times for the fit; brute-force
enumeration of every draft-length assignment for the policy's optimum.
"""
from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import random
import statistics
from pathlib import Path

import pytest

from onecard.checkpoint_meta import read_checkpoint_meta
from onecard.core.spec.cost import (
    H200_T4,
    SHIPPED_TABLES,
    CostModel,
    MeasuredTable,
    ModelShape,
    card_spec,
    eager_mode,
    eager_overhead_s,
    expected_distinct_experts,
    gptq_weight_bytes,
)
from onecard.core.spec.policy import SpecPolicy, expected_tokens

_FULL_SIZE = Path(__file__).resolve().parents[2] / "bench" / "full_size.py"


@pytest.fixture(scope="module")
def q30_config() -> dict:
    """The Qwen3-30B-A3B config the GPU benches build (bench/full_size.py: the one home of that shape)."""
    spec = importlib.util.spec_from_file_location("full_size_for_spec_test", _FULL_SIZE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.CONFIG)


@pytest.fixture(scope="module")
def shape(q30_config) -> ModelShape:
    return ModelShape.from_hf_config(q30_config)


# ------------------------------------------------------------------ cost model
@pytest.mark.parametrize("n", [1, 2, 3, 9, 16, 48, 144])
def test_union_formula_matches_monte_carlo(n):
    rng = random.Random(1234 + n)
    trials = 3000
    counts = []
    for _ in range(trials):
        seen: set[int] = set()
        for _ in range(n):
            seen.update(rng.sample(range(128), 8))
        counts.append(len(seen))
    mean, sd = statistics.fmean(counts), statistics.pstdev(counts)
    want = expected_distinct_experts(n, 128, 8)
    assert abs(mean - want) <= 4 * sd / trials ** 0.5 + 1e-9, (n, mean, want)


def test_union_edges():
    assert expected_distinct_experts(0, 128, 8) == 0.0
    assert expected_distinct_experts(1, 128, 8) == pytest.approx(8.0)
    assert expected_distinct_experts(10_000, 128, 8) == pytest.approx(128.0)


def test_bytes_match_the_tiny_gptq_checkpoint(tiny_moe_gptq_dir):
    meta = read_checkpoint_meta(Path(tiny_moe_gptq_dir))
    c = meta.hf_config
    q = meta.quant
    s = ModelShape.from_hf_config(c, bits=q.bits, group_size=q.group_size)

    def gptq(prefix: str) -> int:        # as a kernel reads it: packed ints + fp16 scales
        t = meta.tensors
        return (t[prefix + ".qweight"].nbytes + t[prefix + ".qzeros"].nbytes + t[prefix + ".scales"].numel * 2)

    p = "model.layers.0"
    expert = sum(gptq(f"{p}.mlp.experts.0.{w}_proj") for w in ("gate", "up", "down"))
    assert s.expert_bytes == pytest.approx(expert)
    attn = sum(gptq(f"{p}.self_attn.{w}_proj") for w in "qkvo")
    router = meta.tensors[f"{p}.mlp.gate.weight"].numel * 2
    lm_head = meta.tensors["lm_head.weight"].numel * 2
    assert s.dense_bytes == pytest.approx(s.layers * (attn + router) + lm_head)
    assert gptq_weight_bytes(256, 64, None) == 256 * 64 * 2


def test_h200_fit_reproduces_the_measured_steps(shape):
    m = CostModel.for_card("NVIDIA H200", shape)
    for b in (1, 16):
        assert m.step_time(b, b) == pytest.approx(H200_T4["tpot_s"][b], rel=0.01)


@pytest.mark.parametrize("card", ["H200", "H100", "Tesla V100-SXM2-32GB"])
@pytest.mark.parametrize("batch", [1, 16])
def test_verify_cost_grows_with_k_and_union(shape, card, batch):
    m = CostModel.for_card(card, shape)
    rel = [m.relative_cost(batch, [k] * batch) for k in range(9)]
    assert rel[0] == pytest.approx(1.0)
    assert all(b > a for a, b in itertools.pairwise(rel))
    # the MoE's share: at batch 1 the union grows ~7x from k=0 to k=8, so the cost grows by more than 30%
    if batch == 1:
        assert rel[8] > 1.3
    assert m.verify_cost(batch, [1] * batch) == pytest.approx(m.step_time(batch, 2 * batch))
    with pytest.raises(ValueError):
        m.verify_cost(batch + 1, [1] * batch)


def test_union_correction_lowers_the_cost(shape):
    table = MeasuredTable(512, {1: {1: 2.6e-3, 2: 3.0e-3}}, union_correction=0.5)
    plain, corrected = CostModel(shape, card_spec("H200")), CostModel(shape, card_spec("H200"), table)
    assert corrected.analytic(1, 9) < plain.analytic(1, 9)
    assert corrected.analytic(1, 1) == pytest.approx(plain.analytic(1, 1))    # top_k experts stay


def _write_table(path: Path, card: str, rows: dict[int, dict[int, float]]) -> Path:
    path.write_text(json.dumps({"cards": {card: {"context": 512, "step_s": {
        str(b): {str(t): s for t, s in r.items()} for b, r in rows.items()}}}}))
    return path


def test_table_used_when_present_for_the_card(shape, tmp_path):
    rows = {1: {t: 2.0e-3 + 0.5e-3 * (t - 1) for t in range(1, 10)},
            16: {t: 6.0e-3 * t for t in range(1, 10)}}
    path = _write_table(tmp_path / "verify.json", "NVIDIA H200", rows)
    m = CostModel.for_card("H200", shape, path)
    assert m.source == "measured table"
    assert m.step_time(1, 4) == pytest.approx(rows[1][4])
    assert m.step_time(16, 16 * 3) == pytest.approx(rows[16][3])
    assert m.step_time(16, 16 + 8) == pytest.approx((rows[16][1] + rows[16][2]) / 2)     # 1.5 per sequence
    assert m.step_time(1, 12) == pytest.approx(rows[1][9] + 3 * 0.5e-3)                  # extended
    # a batch between the measured ones: the table's relative cost at the nearest batch carries over
    near = m.step_time(8, 16) / m.step_time(8, 8)
    assert near == pytest.approx(m.analytic(8, 16) / m.analytic(8, 8) * 2.0 / (m.analytic(16, 32) / m.analytic(16, 16)))
    # another card: the analytic model
    other = CostModel.for_card("H100", shape, path)
    assert other.table is None and other.step_time(1, 4) == pytest.approx(other.analytic(1, 4))
    # a longer context adds the KV read
    assert m.step_time(1, 1, 4096) > m.step_time(1, 1, 512)


def test_table_needs_two_points():
    with pytest.raises(ValueError):
        MeasuredTable.from_json({"step_s": {"1": {"1": 0.002}}})


# ------------------------------------------------------------------ policy
def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 0) == 1.0


def _drafts(n: int, length: int = 8) -> dict[str, list[int]]:
    return {f"r{i}": list(range(length)) for i in range(n)}


def test_zero_acceptance_picks_k0(shape):
    p = SpecPolicy(8, CostModel.for_card("H200", shape))
    for _ in range(20):
        p.record("r0", 8, 0)
    assert p.acceptance("r0") < 0.1
    assert p.choose(_drafts(1)) == {"r0": 0}
    assert p.last.speedup == 1.0


def test_high_acceptance_at_batch1_picks_max_k(shape):
    p = SpecPolicy(8, CostModel.for_card("H200", shape))
    for _ in range(20):
        p.record("r0", 8, 8)
    assert p.acceptance("r0") > 0.9
    assert p.choose(_drafts(1)) == {"r0": 8}
    assert p.last.speedup > 2.0
    assert p.choose({"r0": [5, 6, 7]}) == {"r0": 3}          # the drafter's own length caps k
    assert p.choose({"r0": []}) == {"r0": 0}
    assert p.choose({"r0": 5}) == {"r0": 5}                  # a length is as good as the tokens


def test_off_at_batch16_when_verify_is_expensive(shape, tmp_path):
    # a card where verify tokens cost nearly a full step each at batch 16 (compute-bound), cheap at batch 1
    rows = {1: {t: 2.6e-3 * (1 + 0.08 * (t - 1)) for t in range(1, 10)},
            16: {t: 6.5e-3 * (1 + 0.9 * (t - 1)) for t in range(1, 10)}}
    path = _write_table(tmp_path / "verify.json", "H200", rows)
    cost = CostModel.for_card("H200", shape, path)
    p = SpecPolicy(8, cost, prior_acceptance=0.5)
    ks = p.choose(_drafts(16))
    assert set(ks.values()) == {0} and p.last.draft_tokens == 0
    assert p.choose(_drafts(1)) != {"r0": 0}                 # the same acceptance pays at batch 1
    # and the analytic V100 model says the same at batch 16 with moderate acceptance
    v100 = SpecPolicy(8, CostModel.for_card("V100", shape), prior_acceptance=0.5)
    assert set(v100.choose(_drafts(16)).values()) == {0}


def test_choice_is_the_brute_force_optimum(shape):
    cost = CostModel.for_card("H200", shape)
    p = SpecPolicy(4, cost, min_speedup=1.0)
    outcomes = {"a": (4, 4), "b": (4, 1), "c": (4, 2)}
    for rid, (prop, acc) in outcomes.items():
        for _ in range(3):
            p.record(rid, prop, acc)
    drafts = {"a": [0] * 4, "b": [0] * 3, "c": [0] * 4}
    alphas = {r: p.acceptance(r) for r in drafts}
    ks = p.choose(drafts)

    def rate(assign: dict[str, int]) -> float:
        emitted = sum(expected_tokens(alphas[r], k) for r, k in assign.items())
        return emitted / cost.verify_cost(3, list(assign.values()))

    best = max((dict(zip(drafts, combo)) for combo in itertools.product(*(range(len(d) + 1) for d in drafts.values()))),
               key=rate)
    assert rate(ks) == pytest.approx(rate(best), rel=1e-12)
    assert p.last.speedup == pytest.approx(rate(ks) / rate(dict.fromkeys(drafts, 0)))


def test_record_forget_and_prior(shape):
    p = SpecPolicy(8, CostModel.for_card("H200", shape), prior_acceptance=0.5)
    assert p.acceptance("new") == pytest.approx(0.5)
    for _ in range(30):
        p.record("good", 8, 8)
    assert p.tracked() == 1
    assert p.acceptance("good") > 0.9
    assert p.acceptance("new") > 0.5                          # new requests start from the traffic's rate
    p.record("x", 0, 0)                                       # nothing verified: no evidence
    assert p.tracked() == 1
    p.forget("good")
    p.forget("never-seen")
    assert p.tracked() == 0
    with pytest.raises(ValueError):
        p.record("good", 2, 3)
    with pytest.raises(ValueError):
        p.record("good", 2, -1)
    with pytest.raises(ValueError):
        SpecPolicy(-1, CostModel.for_card("H200", shape))


def test_a_sequence_held_off_drifts_back_to_probing(shape):
    p = SpecPolicy(8, CostModel.for_card("H200", shape), prior_acceptance=0.7)
    for _ in range(10):
        p.record("r0", 8, 0)
    assert p.choose(_drafts(1)) == {"r0": 0}
    steps = 0
    while p.choose(_drafts(1)) == {"r0": 0}:
        steps += 1
        assert steps < 500
    assert steps > 5                                          # not at once: the evidence fades over steps


def _state(p: SpecPolicy) -> dict:
    """Every field of a policy but the step-time memo and the cost model (caches, not state), evidence copied as
    numbers."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if f.name in ("_times", "_monotone", "cost"):
            continue
        if f.name == "_seqs":
            v = {r: (e.successes, e.trials) for r, e in v.items()}
        elif f.name == "_global":
            v = (v.successes, v.trials)
        out[f.name] = copy.deepcopy(v)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_peek_answers_as_choose_and_changes_nothing(shape, seed):
    """The async loop's question (would a step verify drafts now?) leaves the policy exactly as it was, while
    ``choose`` on the same drafts gives the same answer."""
    rng = random.Random(seed)
    p = SpecPolicy(6, CostModel.for_card("V100", shape), prior_acceptance=0.6)   # (verify dear: k = 0 is common)
    ids = [f"r{i}" for i in range(rng.choice((1, 4, 16)))]
    for _ in range(40):
        r = rng.choice(ids)
        k = rng.randrange(1, 7)
        p.record(r, k, rng.choice((0, k, rng.randrange(k + 1))))
    for _ in range(8):
        p.record(ids[0], 6, 0)                    # a sequence the policy holds at k = 0 (its evidence fades)
    p.choose({r: rng.randrange(7) for r in ids})
    for _ in range(30):
        drafts = {r: rng.randrange(7) for r in ids + ["new"]}
        ctx = {r: rng.randrange(10, 3000) for r in drafts}
        extra = rng.choice((0, 0, 300))
        before = _state(p)
        peeked = p.peek(drafts, ctx, extra)
        assert _state(p) == before
        assert p.choose(drafts, ctx, extra) == peeked


@pytest.mark.parametrize("seed", range(4))
def test_peek_keep_plain_is_choose_when_plain_and_peek_when_drafting(shape, seed):
    """``peek(keep_plain=True)`` (the async loop's one pricing per step): a plain answer leaves the policy as
    ``choose`` would (its per-step fading), a drafting answer leaves it as it was."""
    import copy

    rng = random.Random(seed)
    p = SpecPolicy(6, CostModel.for_card("V100", shape), prior_acceptance=0.6)
    ids = [f"r{i}" for i in range(rng.choice((1, 4, 16)))]
    for _ in range(40):
        r = rng.choice(ids)
        k = rng.randrange(1, 7)
        p.record(r, k, rng.choice((0, k, rng.randrange(k + 1))))
    seen = set()
    for step in range(31):
        if step == 30:                            # last: every draft rejected so far, so the answer is plain
            for r in ids:
                for _ in range(40):
                    p.record(r, 6, 0)
        drafts = {r: rng.randrange(1, 7) for r in ids}
        ctx = {r: rng.randrange(10, 3000) for r in drafts}
        before = _state(p)
        twin = copy.deepcopy(p)
        ks = p.peek(drafts, ctx, 0, keep_plain=True)
        assert twin.choose(drafts, ctx, 0) == ks
        plain = not any(ks.values())
        seen.add(plain)
        assert _state(p) == (_state(twin) if plain else before)
    assert True in seen                           # the plain branch ran (and matched choose above)


def test_peek_equals_choose_on_the_same_state(shape):
    p = SpecPolicy(8, CostModel.for_card("H200", shape), prior_acceptance=0.7)
    for _ in range(10):
        p.record("r0", 8, 0)
    p.record("r1", 4, 4)
    r0 = (p._seqs["r0"].trials, p._seqs["r0"].successes)
    last = p.last
    assert p.peek({"r0": 8}) == {"r0": 0}                          # r0 is held at k = 0 with a draft ...
    assert p.last is last and (p._seqs["r0"].trials, p._seqs["r0"].successes) == r0
    assert p.choose({"r0": 8}) == {"r0": 0} and p.last is not last
    assert p._seqs["r0"].trials < r0[0]                              # ... which choose (not peek) fades
    drafts, ctx = {"r0": 8, "r1": 8, "r2": 3}, {"r0": 700, "r1": 90, "r2": 4000}
    want = p.peek(drafts, ctx, 64)
    assert want["r1"] > 0 and "r2" not in p._seqs
    assert p.choose(drafts, ctx, 64) == want


# ------------------------------------------------------------------ the GPU bench's CPU side: projection
def _load_project():
    path = Path(__file__).resolve().parents[2] / "bench" / "spec_verify_project.py"
    spec = importlib.util.spec_from_file_location("spec_verify_project_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("layout", ["nested", "records"])
def test_projection_from_acceptance_histograms(tmp_path, layout):
    proj = _load_project()
    alpha, k = 0.7, 4
    hist = [1000 * alpha ** j * (1 - alpha) for j in range(k)] + [1000 * alpha ** k]     # geometric, truncated
    if layout == "nested":
        data = {"methods": {"ngram": {"k": {str(k): {"histogram": hist}}}, "suffix": {"2": [5, 3, 2]}}}
    else:
        data = {"results": [{"method": "ngram", "k": k, "accepted_hist": hist},
                            {"method": "suffix", "k": 2, "accepted_hist": [5, 3, 2]}]}
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(data))
    acc = proj.load_acceptance(path)
    assert set(acc) == {"ngram", "suffix"} and set(acc["ngram"]) == {k} and set(acc["suffix"]) == {2}
    table = {"context": 512, "step_s": {"1": {"1": 2e-3, "5": 3e-3}, "16": {"1": 6e-3, "3": 9e-3, "5": 12e-3}}}
    out = proj.project(acc, table, [1, 16])
    row = out["methods"]["ngram"][k]
    assert row["alpha"] == pytest.approx(alpha)
    mean = sum(j * c for j, c in enumerate(hist)) / sum(hist)
    assert row["mean_accepted"] == pytest.approx(mean)
    assert row["speedup"][1] == pytest.approx((1 + mean) * 2e-3 / 3e-3)
    assert row["speedup"][16] == pytest.approx((1 + mean) * 6e-3 / 12e-3)
    assert out["best"]["suffix"][1][0] == 2
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"note": "nothing"}))
    with pytest.raises(ValueError):
        proj.load_acceptance(empty)


def test_cost_model_for_an_engine_config(tiny_moe_gptq_dir):
    from onecard.config import EngineArgs

    cfg = EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu").create_config()
    m = CostModel.for_engine(cfg, "NVIDIA H200")
    meta = read_checkpoint_meta(Path(tiny_moe_gptq_dir))
    assert (m.shape.bits, m.shape.group_size) == (meta.quant.bits, meta.quant.group_size)
    assert m.shape.num_experts == int(meta.hf_config["num_experts"]) and m.card.name == "H200"
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.model.dtype]              # KV "auto" = the model's
    assert m.shape.kv_bytes_per_token == cfg.model.num_layers * 2 * cfg.model.num_kv_heads * m.shape.head_dim * elem


def test_policy_keeps_steps_off_the_expensive_kernel_paths(shape):
    from onecard.kernels import paths

    cost = CostModel.for_card("H200", shape)
    # the dequantize + cuBLAS dense path costs 2 fp16 copies of the attention weights per layer
    assert cost.step_time(16, 128) - cost.step_time(16, 127) > 0.1 * cost.step_time(16, 16)
    p = SpecPolicy(8, cost, prior_acceptance=0.9)
    ks = p.choose(_drafts(16))
    assert 16 + sum(ks.values()) < paths.DENSE_CUBLAS_MIN_M <= 16 * 9
    ks = p.choose(_drafts(32))
    assert 32 + sum(ks.values()) < paths.GROUPED_MIN_TOKENS <= 32 * 9


def test_projection_counts_each_step_at_its_draft_length(tmp_path):
    proj = _load_project()
    # bench/spec_acceptance.py's layout: 10 steps without a draft, 20 with a 2-token draft (a = 0, 1, 2: 5, 5, 10)
    rec = {"workload": "edit", "method": "edit:ngram", "k": 2, "accepted_hist": [15, 5, 10],
           "steps_by_draft_len": {"0": {"0": 10}, "2": {"0": 5, "1": 5, "2": 10}}}
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"meta": {"packages": {"attrs": ["25.2.0", "25.3.0"]}}, "results": [rec]}))
    acc, by_len = proj.load_acceptance(path), proj.load_steps_by_draft_len(path)
    assert acc == {"edit:ngram": {2: [15.0, 5.0, 10.0]}}
    table = {"context": 512, "step_s": {"1": {"1": 2.0, "2": 2.5, "3": 3.0}}}
    row = proj.project(acc, table, [1], by_len)["methods"]["edit:ngram"][2]
    emitted = 10 * 1 + 5 * 1 + 5 * 2 + 10 * 3
    assert row["speedup"][1] == pytest.approx(emitted * 2.0 / (10 * 2.0 + 20 * 3.0))
    assert row["alpha"] == pytest.approx((5 + 2 * 10) / (5 + 2 * 10 + 5 + 5))
    assert row["by_draft_len"]


def test_table_rows_never_fall():
    t = MeasuredTable.from_json({"step_s": {"1": {"1": 3e-3, "2": 2.5e-3, "3": 4e-3}}})
    assert t.step_s[1] == {1: 3e-3, 2: 3e-3, 3: 4e-3}
    assert t.interpolate(1, 5) >= t.interpolate(1, 3)


@pytest.mark.parametrize("seed", range(8))
def test_choice_is_optimal_for_random_acceptances(shape, seed):
    rng = random.Random(seed)
    cost = CostModel.for_card(rng.choice(["H200", "V100"]), shape)
    p = SpecPolicy(3, cost, min_speedup=1.0)
    drafts = {f"s{i}": [0] * rng.randint(0, 3) for i in range(4)}
    for rid in drafts:
        for _ in range(rng.randint(0, 6)):
            prop = 3
            p.record(rid, prop, rng.randint(0, prop))
    alphas = {r: p.acceptance(r) for r in drafts}
    ks = p.choose(drafts)

    def rate(assign):
        return sum(expected_tokens(alphas[r], k) for r, k in assign.items()) / cost.verify_cost(4, list(assign.values()))

    combos = (dict(zip(drafts, c)) for c in itertools.product(*(range(len(d) + 1) for d in drafts.values())))
    assert rate(ks) == pytest.approx(max(rate(c) for c in combos), rel=1e-12)


# ------------------------------------------------------------------ eager verify steps (no CUDA graph for them yet)
_H100 = "NVIDIA H100 80GB HBM3"


def test_for_engine_prices_verify_steps_eager_on_cuda(tiny_moe_gptq_dir):
    import dataclasses

    from onecard.config import EngineArgs

    cpu = EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu").create_config()
    cuda = dataclasses.replace(cpu, device="cuda")           # a CUDA engine's config (no GPU needed to price it)
    assert eager_mode(cuda) == "verify" and eager_mode(cpu) == "all"
    assert eager_mode(dataclasses.replace(cuda, enforce_eager=True)) == "all"
    m = CostModel.for_engine(cuda, _H100)
    assert m.eager == "verify" and m.table is not None and m.table.eager_s is not None
    graphed = CostModel.for_engine(cuda, _H100, eager="none")
    assert m.step_time(1, 1) == graphed.step_time(1, 1)      # 1-token decode steps replay a graph
    assert m.step_time(1, 5) > 3 * graphed.step_time(1, 5)   # a verify step runs eagerly: launch-bound
    other = CostModel.for_engine(cuda, "NVIDIA H200")        # no table for the card: analytic + the eager constant
    assert other.table is None
    assert other.step_time(1, 3) == pytest.approx(other.analytic(1, 3) + eager_overhead_s())
    assert other.step_time(4, 4) == pytest.approx(other.analytic(4, 4))


def test_shipped_table_loads_and_matches_its_raw_timings(shape):
    raw = json.loads(SHIPPED_TABLES.read_text())["cards"][_H100]
    m = CostModel.for_card("H100", shape, SHIPPED_TABLES, eager="verify")
    tb = m.table
    assert tb is not None and sorted(tb.step_s) == sorted(tb.eager_s) == [1, 16]
    for b in ("1", "16"):
        for t in ("1", "2", "9"):             # a row's running max: never below the raw timing of that point
            assert tb.step_s[int(b)][int(t)] >= raw["step_s"][b][t]
            assert tb.eager_s[int(b)][int(t)] >= raw["eager_step_s"][b][t]
    assert m.step_time(1, 1) == pytest.approx(raw["step_s"]["1"]["1"])
    assert m.step_time(16, 16 * 2) == pytest.approx(raw["eager_step_s"]["16"]["2"])
    diffs = sorted(raw["eager_step_s"][b][t] - raw["step_s"][b][t] for b in ("1", "16") for t in map(str, range(2, 10)))
    assert eager_overhead_s() == pytest.approx(statistics.median(diffs))
    assert 5e-3 < eager_overhead_s() < 0.1    # eager launches cost ms per step, not µs and not a second
    # a batch between the measured ones: the graphed estimate plus the nearest batch's eager excess
    near = tb.eager_s[16][2] - tb.step_s[16][2]
    assert m.step_time(8, 16) == pytest.approx(CostModel.for_card("H100", shape, SHIPPED_TABLES).step_time(8, 16) + near)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.9, 0.95])
def test_policy_off_on_the_h100_while_verify_runs_eager(shape, batch, alpha):
    cost = CostModel.for_card(_H100, shape, SHIPPED_TABLES, eager="verify")
    p = SpecPolicy(8, cost, prior_acceptance=alpha, prior_weight=1e9)   # the acceptance pinned at alpha
    assert p.acceptance("r0") == pytest.approx(alpha)
    assert set(p.choose(_drafts(batch)).values()) == {0} and p.last.speedup == 1.0
    # the reason: even k = 8 at this acceptance emits fewer tokens per second than the graphed plain step
    gain = batch * expected_tokens(alpha, 8) / cost.step_time(batch, batch * 9)
    assert gain / (batch / cost.step_time(batch, batch)) < 1.0


def test_graphed_h100_table_still_drafts_at_high_acceptance(shape):
    cost = CostModel.for_card(_H100, shape, SHIPPED_TABLES)             # verify steps from CUDA graphs
    p = SpecPolicy(8, cost, prior_acceptance=0.95, prior_weight=1e9)
    assert p.choose(_drafts(1)) == {"r0": 8} and p.last.speedup > 2.0


# ------------------------------------------------------------------ verify steps from padded CUDA graphs
def _padded_cost(shape, max_num_seqs: int, k: int) -> CostModel:
    from onecard.runner.graph_shapes import VerifyGraphs

    return CostModel(shape, card_spec(_H100), CostModel.for_card(_H100, shape, SHIPPED_TABLES).table, "verify",
                     VerifyGraphs.of(max_num_seqs, k))


def test_for_engine_prices_graphed_verify_steps_with_speculation(tiny_moe_gptq_dir, shape):
    import dataclasses

    from onecard.config import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 16}
    cpu = EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu", max_num_seqs=16, speculative_config=spec).create_config()
    cuda = dataclasses.replace(cpu, device="cuda")
    m = CostModel.for_engine(cuda, _H100)
    graphed = CostModel.for_engine(cuda, _H100, eager="none")
    assert m.verify_graphs is not None and m.pads_verify(1) and m.pads_verify(16)
    assert CostModel.for_engine(dataclasses.replace(cuda, enforce_eager=True), _H100).verify_graphs is None
    assert CostModel.for_engine(dataclasses.replace(cuda, speculative=None), _H100).verify_graphs is None
    assert m.padded_step_time(1, 9) == pytest.approx(graphed.step_time(1, 9))        # the graphed row
    assert m.padded_step_time(3, 5) == pytest.approx(graphed.step_time(3, 15))       # T(B, B·q)
    assert m.step_time(1, 9) > 3 * graphed.step_time(1, 9)   # a step the graphs do not take (a chunk) stays eager
    assert m.padded_step_time(16, 16) is None                # 16 x 16 rows: past the verify graphs' bound
    assert m.padded_step_time(16, 15) == pytest.approx(graphed.step_time(16, 16 * 15))


@pytest.mark.parametrize("seed", range(10))
def test_padded_choice_is_optimal_over_every_assignment(shape, seed):
    rng = random.Random(seed)
    batch, k = rng.choice([(3, 4), (4, 4), (2, 6)])
    # seed-dependent graph coverage: max_num_seqs 64 x k 4 covers every q; max_num_seqs 4 x k 2 only q <= 3
    cost = _padded_cost(shape, *rng.choice([(64, k), (4, 2)]))
    p = SpecPolicy(k, cost, min_speedup=1.0, prior_acceptance=rng.uniform(0.3, 0.99))
    drafts = {f"s{i}": [0] * rng.randint(0, k) for i in range(batch)}
    for rid in drafts:
        for _ in range(rng.randint(0, 8)):
            p.record(rid, k, rng.choice([0, k, k, rng.randint(0, k)]))
    alphas = {r: p.acceptance(r) for r in drafts}
    ks = p.choose(drafts)
    assert p.last.draft_tokens == sum(ks.values())

    def rate(assign: dict[str, int]) -> float:
        q = 1 + max(assign.values())
        t = cost.padded_step_time(batch, q)
        if t is None:                                        # no graph for that q: the eager step, as laid out
            t = cost.step_time(batch, batch + sum(assign.values()))
        return sum(expected_tokens(alphas[r], n) for r, n in assign.items()) / t

    combos = [dict(zip(drafts, c)) for c in itertools.product(*(range(len(d) + 1) for d in drafts.values()))]
    best = max(rate(c) for c in combos)
    assert rate(ks) == pytest.approx(best, rel=1e-12)
    assert p.last.speedup == pytest.approx(best / rate(dict.fromkeys(drafts, 0)), rel=1e-12)


@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.95])
def test_graphed_policy_drafts_at_batch_1(shape, alpha):
    cost = _padded_cost(shape, 16, 8)
    p = SpecPolicy(8, cost, prior_acceptance=alpha, prior_weight=1e9)
    ks = p.choose(_drafts(1))
    assert ks["r0"] > 0 and p.last.speedup > 1.03
    q = 1 + ks["r0"]
    assert p.last.step_time_s == pytest.approx(cost.padded_step_time(1, q))
    # with a prefill chunk in the step the graphs do not take it: the eager step as laid out (B + Σk + chunk)
    ks = p.choose(_drafts(1), extra_tokens=64)
    assert p.last.step_time_s == pytest.approx(cost.step_time(1, 1 + 64 + ks["r0"]))


def test_graphed_policy_gives_every_sequence_the_common_cap(shape):
    cost = _padded_cost(shape, 16, 8)
    p = SpecPolicy(8, cost, prior_acceptance=0.95, prior_weight=1e9, min_speedup=1.0)
    drafts = {"long": [0] * 8, "short": [0] * 2, "none": []}
    ks = p.choose(drafts)
    c = max(ks.values())
    assert c > 0 and ks == {"long": c, "short": min(2, c), "none": 0}
