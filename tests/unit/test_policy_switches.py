"""bench/policy_switches.py (the policy specs of long_context.py and full_size.py's BENCH_POLICY): "+NAME" sets what
NAME names and nothing else, whatever order the setters were registered in (several of them replace one config
constant: fused_moe/slices.SLICES_CONFIG), and a plain policy puts every shipped value back."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import policy_switches as lc
from onecard.kernels import paths
from onecard.kernels.fused_moe import slices


def _slices_knobs() -> tuple:
    return slices.SLICES_CONFIG


@pytest.fixture
def shipped():
    knobs = _slices_knobs()
    yield knobs
    lc.set_switches("fill")
    assert _slices_knobs() == knobs


@pytest.mark.parametrize("name", ["slices16", "slices1664", "slices3216", "slices_st3", "slices_st8",
                                  "slices_st3h512", "slices16_st3", "slices16w4_st3", "slices16w4k64_st3",
                                  "slices_k64_st3", "slices_one_ahead"])
def test_each_slices_config_policy_sets_its_own_config(shipped, name):
    setters = lc.switch_setters()
    setters[name](True)                                  # what the name alone sets
    wanted = _slices_knobs()
    setters[name](None)
    assert _slices_knobs() == shipped
    lc.set_switches(f"fill+{name}+no_slices_half2")
    assert _slices_knobs() == wanted and not paths.batch1_slices_half2()
    lc.set_switches("fill")
    assert _slices_knobs() == shipped and paths.batch1_slices_half2() == paths.BATCH1_SLICES_HALF2
