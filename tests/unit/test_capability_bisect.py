"""bench/capability_bisect.py's CPU side: the kernel-path decisions that answer differently at sm80 than at
sm90 are exactly the ones the bisect toggles (a new capability branch must get its own configuration there),
each toggle reverts, and the guard compares the native figure with the best configuration."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import capability_bisect as cb
from onecard.kernels import paths


def test_decisions_that_differ_at_sm80_are_the_toggled_ones():
    diff = cb.decision_diff(90, 80)
    assert set(diff) == {"use_pdl", "grouped_gemm_dtype"}, diff
    assert {"pdl80", "grouped80", "onecard80", "lead80"} <= set(cb.CONFIGS)
    assert cb.decision_diff(90, 90) == {}
    assert "per_expert_moe" in cb.decision_diff(90, 70)          # the probe sees the pre-sm80 branches too


@pytest.mark.parametrize("config", ["pdl80", "grouped80", "onecard80"])
def test_onecard_toggles_apply_and_revert(config):
    t = cb.Toggles()
    before = (paths.use_pdl(1, 90, 1), paths.grouped_gemm_dtype("float16", 90, ("float16", "bfloat16")))
    t.apply(config)
    try:
        if config == "pdl80":
            assert paths.use_pdl(1, 90, 1) is False
        elif config == "grouped80":
            assert paths.grouped_gemm_dtype("float16", 90, ("float16", "bfloat16")) == "float16"
        else:
            assert paths.capability("cuda") == 80
    finally:
        t.revert()
    assert (paths.use_pdl(1, 90, 1), paths.grouped_gemm_dtype("float16", 90, ("float16", "bfloat16"))) == before
    assert paths.emulated_capability() is None


def _run(config, a1, a16, n1):
    return {"config": config, "bs1": {"naive": n1, "warmed": a1, "arrival": a1, "t1_first_ms": 30.0,
                                      "t1_again_ms": 20.0},
            "bs16": {"naive": a16, "warmed": a16, "arrival": a16, "t1_first_ms": 300.0, "t1_again_ms": 200.0},
            "prefill4k_first": 2e4, "prefill4k_again": 2.8e4}


def test_guard_flags_a_native_path_slower_than_another_configuration():
    runs = [_run("native", 400, 2500, 410), _run("lead80", 402, 2490, 520), _run("native", 390, 2520, 400),
            _run("lead80", 398, 2510, 530), _run("native", 405, 2480, 405), _run("lead80", 401, 2500, 515)]
    s = cb.summarize(runs, ["native", "lead80"])
    assert s["lead80"]["bs1_naive"] == 520 and s["native"]["bs1_arrival"] == 400
    g = cb.guard(s)
    assert g["ok"] and g["bs1_arrival"]["best"] == "lead80"         # within 3%: not a regression
    runs += [_run("pdl80", 480, 2500, 480)] * 3
    g = cb.guard(cb.summarize(runs, ["native", "lead80", "pdl80"]))
    assert not g["ok"] and g["bs1_arrival"]["best"] == "pdl80"
