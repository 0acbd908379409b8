"""The batch-1 MoE block in one launch (fused_moe/block1.py) on a GPU, at the served shape: a CUDA graph of 48
launches (one per layer, each its own input), replayed many times with PDL as served, equals the reference on
every launch of every replay, and the kernel's zeroed state is zero again afterwards. Its roles chain through
flags in memory, which the interpreter (programs one after another) cannot race: this is where a missing
release/acquire or a wrong arrival count shows. Skipped without CUDA."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, E, TOPK, I, G, LAYERS = 2048, 128, 8, 768, 128, 48


def _gptq(k: int, n: int, dev):
    from onecard.kernels.types import GPTQWeight

    return GPTQWeight(qweight=torch.randint(-2**31, 2**31 - 1, (E, k // 8, n), dtype=torch.int32, device=dev),
                      qzeros=torch.randint(-2**31, 2**31 - 1, (E, k // G, n // 8), dtype=torch.int32, device=dev),
                      scales=(torch.rand(E, k // G, n, device=dev) * 0.01 + 0.001).half(),
                      g_idx=None, group_size=G, in_features=k, out_features=n)


@pytest.mark.parametrize("variant", [{}, {"route_in": False}, {"ticket": False}, {"route_in": False, "ticket": False}],
                         ids=["one-launch", "route-launch", "no-ticket", "route-launch-no-ticket"])
def test_one_launch_block_in_a_graph_equals_the_reference(variant):
    from onecard.kernels import paths, workspace
    from onecard.kernels.fused_moe import block1, ref
    from onecard.kernels.fused_moe import triton as tk
    from onecard.kernels.triton_common import set_pdl

    dev = torch.device("cuda")
    torch.manual_seed(0)
    set_pdl(1)                                                          # as served: PDL at batch 1 (sm90)
    wg, wu, wd = _gptq(H, I, dev), _gptq(H, I, dev), _gptq(I, H, dev)
    nw = (1 + 0.1 * torch.randn(H, device=dev)).half()
    gate = (torch.randn(E, H, device=dev) / math.sqrt(H)).half()
    xs = [torch.randn(1, H, device=dev).half() for _ in range(LAYERS)]
    rs = [torch.randn(1, H, device=dev).half() for _ in range(LAYERS)]
    assert block1.supported(xs[0], gate, TOPK, wg, wu, wd)
    want = [torch.cat(ref.norm_moe(x, r, nw, 1e-6, gate, wg, wu, wd, TOPK, True)).float() for x, r in zip(xs, rs)]
    paths.set_moe_block1(True)
    block1.set_variant(**variant)
    try:
        eager = [torch.cat(tk.norm_moe(x, r, nw, 1e-6, gate, wg, wu, wd, TOPK, True)).float()
                 for x, r in zip(xs, rs)]
        outs: list[torch.Tensor] = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x, r in zip(xs, rs):
                o, res = tk.norm_moe(x, r, nw, 1e-6, gate, wg, wu, wd, TOPK, True)
                outs.append(torch.cat([o, res.float()]))
    finally:
        paths.set_moe_block1(None)
        block1.set_variant()
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
    assert max(rel(a, b) for a, b in zip(eager, want)) < 1e-2
    worst = 0.0
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, max(rel(o, w) for o, w in zip(outs, want)))
    assert worst < 1e-2, worst
    state = workspace.counters(dev, "moe_block", workspace.REGION_SIZE)
    assert int(state.count_nonzero()) == 0, state.nonzero().flatten().tolist()[:8]
