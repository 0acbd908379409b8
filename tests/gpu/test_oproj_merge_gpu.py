"""GPU-only: the batch-1 split-KV merge in the o_proj GEMV (kernels/paths.BATCH1_OPROJ_MERGE,
attn_in/merge_gemv.py).

With it, batch 1 has a decode graph for the short context class (below SPLIT_MIN_SEQ_LEN), split into at most
SHORT_MERGE_MAX_SEGMENTS segments with no reduce launch; eager decodes at those contexts take the same launches.
So the greedy tokens through the graphs equal eager's at batch 1 and the steps replay the short class; at
batch 3 nothing changes (no class, no merge). The merged rows are the reduce's arithmetic rounded as its output
is, so the tokens also equal those of the path without the switch. The bundled tiny coder (GPTQ g128, fp16)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_context_graphs_gpu import MAX_LEN, _greedy  # the same engine set-up


def _with(on: bool, eager: bool, lens: list[int]):
    from onecard.kernels import paths

    paths.set_switch("batch1_oproj_merge", on)
    try:
        return _greedy(eager, lens, 24)
    finally:
        paths.set_switch("batch1_oproj_merge", None)


def test_batch1_short_class_merges_in_oproj_and_equals_eager_and_the_reduce():
    from onecard.kernels import paths

    short = paths.SPLIT_MIN_SEQ_LEN - 1
    eager, _ = _with(True, True, [700])
    graphed, replays = _with(True, False, [700])
    assert graphed == eager
    assert replays and all(bound == short for (_, bound) in replays), replays
    plain, _ = _with(False, False, [700])
    assert graphed == plain


def test_other_batch_sizes_keep_the_max_model_len_graph():
    graphed, replays = _with(True, False, [300, 650, 120])
    assert all(bound == MAX_LEN for (_, bound) in replays), replays
    plain, _ = _with(False, False, [300, 650, 120])
    assert graphed == plain
