"""Verify-step tables measured at several KV contexts, and the unsplit-attention guard past the measured range
(onecard/core/spec/cost.py; issue 30).

References: the tables' own rows with linear interpolation written out here, the KV-delta rule (B x ΔC x KV bytes
per token / bandwidth) and the unsplit rule (B x ΔC x KV bytes / (B x KV heads x UNSPLIT_PROGRAM_RATE)) computed
from the model shape; the policy's decisions against those prices.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from onecard.core.spec.cost import (
    SHIPPED_TABLES,
    UNSPLIT_GUARD,
    UNSPLIT_PROGRAM_RATE,
    CostModel,
    MeasuredTable,
    ModelShape,
    load_table,
)
from onecard.core.spec.policy import SpecPolicy

_ROOT = Path(__file__).resolve().parents[2]
_H100 = "NVIDIA H100 80GB HBM3"


def _module(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_hf_config(dict(_module("full_size_for_ctx_test", "bench/full_size.py").CONFIG))


def _lin(row: dict[int, float], t: float) -> float:
    xs = sorted(row)
    lo = max(x for x in xs[:-1] if x <= t)       # the last segment extends past the last point
    hi = min(x for x in xs if x > lo)
    return row[lo] + (row[hi] - row[lo]) * (t - lo) / (hi - lo)


def _write(path: Path, per_ctx: dict[int, dict[int, dict[int, float]]], card: str = "H200") -> Path:
    """A bench/spec_verify.py-shaped JSON: the first context at the top level, every context under "contexts"."""
    first = min(per_ctx)
    entry = {"context": first, "step_s": per_ctx[first], "union_correction": 1.0,
             "contexts": {c: {"step_s": rows} for c, rows in per_ctx.items()}}
    path.write_text(json.dumps({"cards": {card: entry}}))
    return path


def _kv_s(m: CostModel, batch: int, dc: float) -> float:
    return batch * dc * m.shape.kv_bytes_per_token / m.card.bandwidth


# rows at 512 and 8192 tokens: batch 1 measured at both, batch 16 at 512 only
_R512 = {1: {1: 3.0e-3, 3: 4.0e-3, 9: 5.0e-3}, 16: {1: 6.5e-3, 9: 40e-3}}
_R8K = {1: {1: 4.0e-3, 3: 9.0e-3, 9: 17.0e-3}}


def test_linear_in_context_between_measured_contexts(shape, tmp_path):
    m = CostModel.for_card("H200", shape, _write(tmp_path / "t.json", {512: _R512, 8192: _R8K}))
    assert [x.context for x in m.table.by_context()] == [512, 8192]
    for ctx in (512, 2048, 4352, 8192):
        f = (ctx - 512) / (8192 - 512)
        for t in (1, 2, 3, 6, 9):
            want = _lin(_R512[1], t) * (1 - f) + _lin(_R8K[1], t) * f
            assert m.step_time(1, t, ctx) == pytest.approx(want, rel=1e-12), (ctx, t)


def test_extrapolation_from_the_nearest_two_never_below_the_kv_rule(shape, tmp_path):
    m = CostModel.for_card("H200", shape, _write(tmp_path / "t.json", {512: _R512, 8192: _R8K}))
    ctx = 16384                           # <= 2 x 8192: the measured slope carries on
    slope = (_R8K[1][9] - _R512[1][9]) / (8192 - 512)
    assert m.step_time(1, 9, ctx) == pytest.approx(_R8K[1][9] + slope * (ctx - 8192), rel=1e-12)
    # below the shortest context the steep verify slope would undercut the KV rule: the rule holds
    want = max(_R512[1][9] + (_R8K[1][9] - _R512[1][9]) * (128 - 512) / (8192 - 512),
               _R512[1][9] + _kv_s(m, 1, 128 - 512))
    assert m.step_time(1, 9, 128) == pytest.approx(want, rel=1e-12)
    assert m.step_time(1, 9, 128) == pytest.approx(_R512[1][9] + _kv_s(m, 1, 128 - 512), rel=1e-12)
    # a measured slope flatter than the KV read (here: none) extrapolates no lower than the KV rule
    flat = CostModel.for_card("H200", shape, _write(tmp_path / "f.json", {512: _R512, 8192: {1: _R512[1]}}))
    assert flat.step_time(1, 1, 16000) == pytest.approx(_R512[1][1] + _kv_s(flat, 1, 16000 - 8192), rel=1e-12)


def test_batch_measured_at_one_context_uses_every_context(shape, tmp_path):
    m = CostModel.for_card("H200", shape, _write(tmp_path / "t.json", {512: _R512, 8192: _R8K}))
    # batch 16 is measured at 512 only: at 8192 it is the batch-1 row scaled (the nearest-batch rule) and the
    # price runs linear between the two contexts' estimates
    at512, at8k = m._at(m.table, 16, 16 * 3), m._at(m.table.more[8192], 16, 16 * 3)
    assert at512 == pytest.approx(_lin(_R512[16], 3))
    assert m.step_time(16, 48, 4352) == pytest.approx((at512 + at8k) / 2, rel=1e-12)
    # batch 16 measured at 512 and 8192 but not at 32768 (KV memory): its own two contexts extrapolate
    r8k16 = {**_R8K, 16: {1: 9e-3, 9: 60e-3}}
    m3 = CostModel.for_card("H200", shape, _write(tmp_path / "t3.json", {512: _R512, 8192: r8k16, 32768: _R8K}))
    slope = (60e-3 - 40e-3) / (8192 - 512)
    assert m3.step_time(16, 16 * 9, 16384) == pytest.approx(60e-3 + slope * (16384 - 8192), rel=1e-12)


def test_single_context_table_prices_as_before(shape, tmp_path):
    one = CostModel.for_card("H200", shape, _write(tmp_path / "one.json", {512: _R512}))
    assert one.table.more == {}
    for ctx in (64, 512, 700, 1024):                       # within UNSPLIT_GUARD x 512: the KV-delta rule
        for b, row in _R512.items():
            for t in (1, 2, 5, 9):
                assert one.step_time(b, b * t, ctx) == pytest.approx(_lin(row, t) + _kv_s(one, b, ctx - 512),
                                                                     rel=1e-12), (ctx, b, t)
    for ctx in (4096, 32768, 131072):                      # plain decode steps split the KV: the rule everywhere
        assert one.step_time(1, 1, ctx) == pytest.approx(_R512[1][1] + _kv_s(one, 1, ctx - 512), rel=1e-12)
    # "contexts" repeating the top-level context changes nothing
    path = tmp_path / "rep.json"
    path.write_text(json.dumps({"cards": {"H200": {"context": 512, "step_s": _R512,
                                                   "contexts": {"512": {"step_s": _R512}}}}}))
    rep = CostModel.for_card("H200", shape, path)
    assert rep.table.more == {} and rep.step_time(16, 80, 900) == one.step_time(16, 80, 900)


def _one_context_copy(tmp_path: Path) -> Path:
    """The shipped H100 table cut to its 512-token rows (a card measured at one context)."""
    d = json.loads(SHIPPED_TABLES.read_text())
    entry = {k: v for k, v in d["cards"][_H100].items() if k != "contexts"}
    path = tmp_path / "one_context.json"
    path.write_text(json.dumps({**d, "cards": {_H100: entry}}))
    return path


@pytest.fixture
def unsplit_verify():
    """Verify steps' attention without split-KV (paths.set_switch("small_q_split", False)), as before the H100 A/B."""
    from onecard.kernels import paths

    paths.set_switch("small_q_split", False)
    yield
    paths.set_switch("small_q_split", None)


def test_unsplit_guard_past_twice_the_measured_context(shape, tmp_path, unsplit_verify):
    one = _one_context_copy(tmp_path)
    m = CostModel.for_card(_H100, shape, one)
    tb = load_table(one, _H100)
    assert tb.more == {} and tb.context == 512
    kvb, kvh = shape.kv_bytes_per_token, shape.kv_heads
    for b, t in ((1, 9), (1, 3), (16, 3)):
        rule = tb.interpolate(b, t)
        limit = int(UNSPLIT_GUARD * 512)
        assert m.step_time(b, b * t, limit) == pytest.approx(rule + _kv_s(m, b, limit - 512), rel=1e-12)
        rate = min(m.card.bandwidth, b * kvh * UNSPLIT_PROGRAM_RATE)
        for ctx in (8192, 32768):
            want = rule + b * (ctx - 512) * kvb / rate
            assert m.step_time(b, b * t, ctx) == pytest.approx(want, rel=1e-12), (b, t, ctx)
            assert m.step_time(b, b * t, ctx) > rule + _kv_s(m, b, ctx - 512)
    # the analytic model (no table) gets the guard past 2 x its fit's contexts as well
    a = CostModel.for_card("H200", shape)
    assert a.step_time(1, 9, 32768) > a.analytic(1, 9, 32768)
    assert a.step_time(1, 9, 1024) == a.analytic(1, 9, 1024) and a.step_time(1, 1, 32768) == a.analytic(1, 1, 32768)


def test_split_verify_steps_skip_the_guard(shape, tmp_path):
    """With small-q split-KV (the default) a verify step (<= SPLIT_MAX_QUERY rows per sequence) is priced like a
    decode step past the table (its row + the KV delta); a step of more rows per sequence keeps the guard."""
    from onecard.kernels import paths

    assert paths.small_q_split()
    one = _one_context_copy(tmp_path)
    m = CostModel.for_card(_H100, shape, one)
    tb = load_table(one, _H100)
    for b, t in ((1, 9), (16, 3)):
        assert m.step_time(b, b * t, 32768) == pytest.approx(tb.interpolate(b, t) + _kv_s(m, b, 32768 - 512),
                                                             rel=1e-12)
    big = paths.SPLIT_MAX_QUERY + 1
    assert m.step_time(1, big, 32768) > tb.interpolate(1, big) + _kv_s(m, 1, 32768 - 512)


@pytest.mark.parametrize("alpha", [0.8, 0.95])
def test_policy_off_at_32k_without_a_long_context_table(shape, alpha, tmp_path, unsplit_verify):
    p = SpecPolicy(8, CostModel.for_card(_H100, shape, _one_context_copy(tmp_path)), prior_acceptance=alpha,
                   prior_weight=1e9)
    drafts = {"r0": list(range(8))}
    assert p.choose(drafts, {"r0": 512})["r0"] > 0
    assert p.choose(drafts, {"r0": 32768}) == {"r0": 0} and p.last.speedup == 1.0


def test_shipped_table_is_measured_at_long_contexts_and_prices_them(shape):
    """The shipped H100 table holds 8k and 32k rows, measured with split-KV verify attention (a verify step of 9
    rows at 32k: 2x a decode step, was 13x unsplit); the policy prices steps with them: at batch 1 it drafts at
    512 and at 32k tokens of context at α = 0.8 and 0.95, and stays off at α = 0.3."""
    tb = load_table(SHIPPED_TABLES, _H100)
    assert tb.context == 512 and {8192, 32768} <= set(tb.more)
    m = CostModel.for_card(_H100, shape, SHIPPED_TABLES)
    assert 1.2 * m.step_time(1, 1, 32768) < m.step_time(1, 9, 32768) < 2.5 * m.step_time(1, 1, 32768)
    drafts = {"r0": list(range(8))}
    for alpha in (0.8, 0.95):
        p = SpecPolicy(8, m, prior_acceptance=alpha, prior_weight=1e9)
        assert p.choose(drafts, {"r0": 512})["r0"] > 0
        assert p.choose(drafts, {"r0": 32768})["r0"] > 0
    p = SpecPolicy(8, m, prior_acceptance=0.3, prior_weight=1e9)
    assert p.choose(drafts, {"r0": 32768}) == {"r0": 0}


def test_policy_follows_a_measured_32k_table(shape, tmp_path):
    cheap512 = {1: {t: 3.0e-3 + 0.25e-3 * (t - 1) for t in range(1, 10)}}
    plain32k = cheap512[1][1] + 32256 * shape.kv_bytes_per_token / 2.4e12
    dear32k = {1: {1: plain32k, 2: 40e-3, 5: 45e-3, 9: 50e-3}}          # unsplit verify: ~10x a plain step
    fair32k = {1: {1: plain32k, 2: plain32k * 1.05, 9: plain32k * 1.6}}
    drafts = {"r0": list(range(8))}
    for rows, drafts_at_32k in ((dear32k, False), (fair32k, True)):
        path = _write(tmp_path / "p.json", {512: cheap512, 32768: rows})
        cost = CostModel.for_card("H200", shape, path)
        p = SpecPolicy(8, cost, prior_acceptance=0.9, prior_weight=1e9)
        assert p.choose(drafts, {"r0": 512})["r0"] > 0
        assert (p.choose(drafts, {"r0": 32768})["r0"] > 0) is drafts_at_32k
        assert cost.step_time(1, 5, 32768) == pytest.approx(_lin(rows[1], 5), rel=1e-12)   # measured: no guard


def test_bench_rows_load_as_a_multi_context_table(shape):
    sv = _module("spec_verify_for_ctx_test", "bench/spec_verify.py")
    raw = {512: {"eager_s": {1: {1: 2e-3, 2: 3e-3}}, "graph_s": {1: {1: 1e-3, 2: 2e-3}}},
           8192: {"eager_s": {1: {1: 4e-3, 2: 9e-3}}, "graph_s": {1: {1: 3e-3}}}}       # 8k: one graph failed
    host = {1: 0.5e-3}
    rows = {c: sv.card_rows(r, host) for c, r in raw.items()}
    assert rows[512]["timing"] == "graph" and rows[8192]["timing"] == "eager"
    entry = json.loads(json.dumps({"context": 512, **rows[512], "contexts": rows}))          # as written to disk
    m = CostModel(shape, CostModel.for_card("H200", shape).card, MeasuredTable.from_json(entry))
    assert m.step_time(1, 2, 512) == pytest.approx(2e-3 + 0.5e-3)
    assert m.step_time(1, 2, 8192) == pytest.approx(9e-3 + 0.5e-3)                          # eager timings
    assert m.table.more[8192].eager_s[1][2] == pytest.approx(9e-3 + 0.5e-3)

