"""Split-KV of small-q launches (speculative verify steps, paths switch "small_q_split") under TRITON_INTERPRET=1
against the float32 reference (splitq_cases.py's cases, in interpret_cases.py's worker subprocess): uniform and
ragged query rows (1 to 9) per sequence, one and two q-blocks, contexts that fill some segments only, 1-tile
segments where a q-block's first rows see none of its last segment's keys, the CUDA graphs' padded verify layout,
fp32, fp16 and fp8_e5m2 caches, and sm70's tiles."""
from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interpret_cases import assert_within_bound, module_worker
from splitq_cases import SPLITQ_CASES

pytest.importorskip("triton")
SEED = int(time.time()) % 100_000
worker = module_worker(SPLITQ_CASES, SEED)


@pytest.mark.parametrize("case", SPLITQ_CASES)
def test_split_small_q_matches_float32_reference(worker, case):
    assert_within_bound(worker.result(case), case, SEED)       # fp16 q/p/output (fp8: the same bytes in both)
