"""Split-KV decode attention under TRITON_INTERPRET=1 against the float32 reference (interpret_cases.py's
``splitkv`` cases, in their own subprocess as test_triton_interpret.py does): forced segment counts (2, 3, 7, 40,
a shortest segment of 3 tiles), the "fill" and "legacy" policies' own choices at a CUDA-graph-like bound, fp32,
fp16 and fp8_e5m2 caches, and sm70's tiles. The contexts (1 to 2,100 keys) leave segments past a sequence's end
and make the reduce merge more than one BLOCK_S step."""
from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interpret_cases import SPLITKV_CASES, assert_within_bound, module_worker

pytest.importorskip("triton")
SEED = int(time.time()) % 100_000
worker = module_worker(SPLITKV_CASES, SEED)


@pytest.mark.parametrize("case", SPLITKV_CASES)
def test_split_kv_decode_matches_float32_reference(worker, case):
    assert_within_bound(worker.result(case), case, SEED)       # fp16 q/p/output (fp8: the same bytes in both)
