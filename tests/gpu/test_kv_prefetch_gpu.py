"""GPU-only: the batch-1 read of the next layer's KV into L2 (kernels/paths.BATCH1_KV_PREFETCH,
layers/kv_prefetch.py: attention/triton.kv_touch on a side stream, forked after each attention block, joined at the
end of the forward). The reads change no value: with the switch on, the bundled tiny coder's batch-1 greedy tokens
equal those with it off, from CUDA graphs and eagerly, and the reads did run (kv_touch launches counted). The
kernel against its reference at the served shape (4 KV heads, D 128, 16-token blocks): fewer positions than the
sequence holds and more."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))


def _greedy(eager: bool, on: bool) -> tuple[list[list[int]], int]:
    """-> (the tiny coder's greedy tokens, one request at a time: every decode step batch 1; kv_touch launches)."""
    from bench.gpu_checks import CODER, greedy
    from onecard.kernels import dispatch, paths

    calls = [0]
    real = dispatch.kv_touch

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    paths.set_switch("batch1_kv_prefetch", on)
    dispatch.kv_touch = counted
    try:
        return greedy(CODER, "triton", "float16", eager=eager, serial=True, max_model_len=2048), calls[0]
    finally:
        dispatch.kv_touch = real
        paths.set_switch("batch1_kv_prefetch", None)


@pytest.mark.parametrize("eager", [False, True])
def test_kv_prefetch_changes_no_token(eager):
    off, n_off = _greedy(eager, False)
    on, n_on = _greedy(eager, True)
    assert n_off == 0 and n_on > 0
    assert on == off


def test_kv_touch_matches_its_reference_at_the_served_shape():
    from kernels_testlib import make_paged_batch

    from onecard.kernels.attention import ref
    from onecard.kernels.attention import triton as tk
    from onecard.kernels.attention.metadata import AttentionMetadata

    kc, vc, md, _, _ = make_paged_batch([5000], [1], 4, 128, 16, dtype=torch.float16)
    kc, vc = kc.cuda(), vc.cuda()
    md = AttentionMetadata(md.slot_mapping.cuda(), md.query_start_loc.cuda(), md.seq_lens.cuda(),
                           md.block_table.cuda(), 1, 65536, 1)
    for positions in (3000, 12288):
        got = tk.kv_touch(kc, vc, md, positions)
        want = ref.kv_touch(kc.float(), vc.float(), md, positions)
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 1e-5, positions
