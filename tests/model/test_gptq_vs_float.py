"""Our model on a GPTQ checkpoint (packed weights, w4a16 + fused-MoE ref kernels) against HF transformers on a
float checkpoint holding the dequantized weights (decoded by tests/model/common.py's own unpacker)."""
from __future__ import annotations

import pytest
import torch

from onecard.quant.pack import gptq_copy
from tests.model.common import ATOL, RTOL, gptq_to_float_dir, hf_logits, load_hf, load_ours, prompts
from tests.model.paged import PagedCache

CASES = {
    "moe-fixture": None,                                                   # tiny_moe_gptq_dir as built
    "moe-asym-v2-actorder": dict(group_size=32, sym=False, fmt="gptq_v2", desc_act=True),
    "moe-asym-v1-g16": dict(group_size=16, sym=False, fmt="gptq"),
    "dense-sym-v1-whole-column": dict(group_size=-1, sym=True, fmt="gptq"),
}


@pytest.fixture(scope="module", params=list(CASES))
def gptq_pair(request, tiny_moe_gptq_dir, tiny_moe_dir, tiny_dense_dir, tmp_path_factory):
    opts = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    if opts is None:
        qdir = tiny_moe_gptq_dir
    else:
        src = tiny_dense_dir if request.param.startswith("dense") else tiny_moe_dir
        qdir = gptq_copy(src, root / "q", seed=3, **opts)
    return load_ours(qdir), load_hf(gptq_to_float_dir(qdir, root / "float")), qdir


def test_prefill_and_decode_match_dequantized_float(gptq_pair):
    ours, hf, _ = gptq_pair
    v = int(ours.config["vocab_size"])
    seqs = prompts(v, [9, 4, 17], seed=11)
    conts = prompts(v, [6, 6, 6], seed=12)
    cache = PagedCache.for_model(ours, num_blocks=48, block_size=4)
    ids = [cache.new_seq() for _ in seqs]
    outs = cache.step(ours, list(zip(ids, seqs)))
    got = [[ours.compute_logits(h)] for h in outs]
    for t in range(6):
        outs = cache.step(ours, [(sid, [conts[i][t]]) for i, sid in enumerate(ids)])
        for i, h in enumerate(outs):
            got[i].append(ours.compute_logits(h))
    for i, s in enumerate(seqs):
        ref = hf_logits(hf, s + conts[i])                                  # every position
        torch.testing.assert_close(torch.cat(got[i]), ref, rtol=RTOL, atol=ATOL)


def test_really_quantized(gptq_pair):
    """The comparison is not vacuous: the model holds packed weights, and they differ from the float source."""
    ours, _, _qdir = gptq_pair
    a = ours.layers[0].self_attn
    lin = a.qkv_proj if a.fuse_qkv else a.q_proj
    assert lin.gptq is not None and lin.weight is None
    assert ours.weights_bytes > 0
