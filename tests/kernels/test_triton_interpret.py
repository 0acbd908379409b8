"""Every Triton op under TRITON_INTERPRET=1 at tiny and odd shapes against its ref (fresh random data).

The interpreter must be switched on before triton is imported, so the cases run in ONE subprocess
(interpret_cases.py) and this module only reads its results: other tests in this pytest process keep the
compiled (or absent) Triton.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interpret_cases import CASES, FP8_CASES, FP8_EXACT

pytest.importorskip("triton")
SEED = int(time.time()) % 100_000


@pytest.fixture(scope="module")
def results() -> dict:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interpret_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, script, str(SEED)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_ref(results, case):
    err = results[case]
    assert not isinstance(err, str), f"seed {SEED}: {err}"
    if case in FP8_EXACT:
        assert err == 0, f"seed {SEED}: {err:.0f} bytes differ from the fp8 spec"
        return
    if case in FP8_CASES:                                 # already a ratio to its bound (interpret_cases.py)
        assert err <= 1.0, f"seed {SEED}: error / bound = {err:.3g} > 1"
        return
    bound = 1e-2 if case.endswith("fp16") else 1e-4
    assert err < bound, f"seed {SEED}: relative error {err:.3g} >= {bound}"
