"""Every Triton op under TRITON_INTERPRET=1 at tiny and odd shapes against its ref (fresh random data).

The interpreter must be switched on before triton is imported, so the cases run in worker processes
(interpret_cases.py: ShardedRun, one per core) and this module only reads their results: other tests in this
pytest process keep the compiled (or absent) Triton. A worker reports each case as it finishes and each test
waits for its own case, bounded per case (``CASE_TIMEOUT_S``), not per run: a loaded machine makes the run
slower, not red.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interpret_cases import CASES, FP8_CASES, FP8_EXACT, InterpretedRun, assert_within_bound, module_worker

pytest.importorskip("triton")
SEED = int(time.time()) % 100_000
worker = module_worker(CASES, SEED)


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_ref(worker, case):
    err = worker.result(case)
    assert not isinstance(err, str), f"seed {SEED}: {err}"
    if case in FP8_EXACT:
        assert err == 0, f"seed {SEED}: {err:.0f} bytes differ from the fp8 spec"
    elif case in FP8_CASES:                               # already a ratio to its bound (interpret_cases.py)
        assert err <= 1.0, f"seed {SEED}: error / bound = {err:.3g} > 1"
    else:
        assert_within_bound(err, case, SEED)


def test_worker_stall_and_death_fail_with_the_reason():
    """The bound is per case: a worker that reports one case and then stalls fails the next case's wait
    (naming it) instead of hanging; one that exits early fails with its exit status and stderr."""
    code = ("import json, sys, time; print(json.dumps({'a': 0.0}), flush=True); "
            "print('boom', file=sys.stderr, flush=True); time.sleep(float(sys.argv[1]))")
    stalled = InterpretedRun(0, ["a", "b"], case_timeout=1.0, argv=[sys.executable, "-c", code, "60"])
    try:
        assert stalled.result("a") == 0.0
        with pytest.raises(AssertionError, match=r"finished no case in 1 s \(stalled at \['b'\]\): boom"):
            stalled.result("b")
    finally:
        stalled.close()
    exited = InterpretedRun(0, ["a", "b"], case_timeout=60.0, argv=[sys.executable, "-c", code, "0"])
    try:
        with pytest.raises(AssertionError, match=r"exited \(0\) before reporting b .*boom"):
            exited.result("b")
        assert exited.results == {"a": 0.0}
    finally:
        exited.close()
