"""GPU-only: the batch-1 MoE's expert stages in one launch (kernels/paths.BATCH1_MOE_SLICES, fused_moe/slices.py).

With the switch on, the bundled tiny coder (GPTQ g128, fp16) decodes at batch 1 through the slices kernel in every
MoE layer: its greedy tokens from CUDA graphs must equal eager's, and both must equal the tokens of the
two-launch stages (the same sums in another fp32 order); also with the slices routing themselves from the
logits (paths.BATCH1_SLICES_ROUTE), with the router folded into o_proj and no norm-route launch
(paths.BATCH1_ROUTER_FOLD), and under ONECARD_EMULATE_CC=70 — with the slices' dots in fp32 (the switch
paths.BATCH1_SLICES_HALF2 off). The shipped packed-fp16 dots: graphs = eager, and at least 3/4 of the greedy prefix
agrees with the stages (a changed fp16 rounding may flip a near tie). The kernel
against its reference at the real shapes is bench/kernels_gpu.py's "norm_moe T=1 slices" rows
(tests/gpu/test_kernels_gpu.py)."""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _greedy(eager: bool, slices_on: bool, route: bool = False, n_prompt: int = 40,
            new: int = 32, config: tuple | None = None, fold: bool = False,
            half2: bool | None = None) -> tuple[list[int], int]:
    """-> (greedy tokens of one request, slices launches seen while the engine ran). ``config``: replaces
    slices.SLICES_CONFIG (the sm80+ one) while the engine runs. ``fold``: the router folded into o_proj
    (paths.BATCH1_ROUTER_FOLD); then only launches without the norm-route launch count (slices' NORM). ``half2``:
    paths.BATCH1_SLICES_HALF2 forced (None: as shipped, on: the slices' dots in packed fp16)."""
    from bench.gpu_checks import CODER
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore
    from onecard.kernels import paths
    from onecard.kernels.fused_moe import slices
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    launches = [0]
    real = slices.moe_slices

    def counted(*a, **k):
        launches[0] += 1 if not fold or k.get("norm") is not None else 0
        return real(*a, **k)

    paths.set_switch("batch1_moe_slices", slices_on)
    paths.set_switch("batch1_slices_route", route)
    paths.set_switch("batch1_router_fold", fold)
    paths.set_switch("batch1_slices_half2", half2)
    slices.moe_slices = counted
    shipped = slices.SLICES_CONFIG
    if config is not None:
        slices.SLICES_CONFIG = tuple(config)
    try:
        cfg = EngineArgs(model=str(CODER), device="cuda", dtype="float16", max_model_len=2048, enforce_eager=eager,
                         kv_cache_memory_bytes=128 << 20, max_num_seqs=2).create_config()
        core = EngineCore(cfg)
        vocab = int(cfg.model.hf_config["vocab_size"])
        prompt = torch.randint(3, vocab, (n_prompt,), generator=torch.Generator().manual_seed(5)).tolist()
        core.add_request(EngineRequest("0", prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                                       time.monotonic(), []))
        out: list[int] = []
        while core.has_unfinished():
            for o in core.step():
                out.extend(o.new_token_ids)
        return out, launches[0]
    finally:
        slices.moe_slices, slices.SLICES_CONFIG = real, shipped
        paths.set_switch("batch1_moe_slices", None)
        paths.set_switch("batch1_slices_route", None)
        paths.set_switch("batch1_router_fold", None)
        paths.set_switch("batch1_slices_half2", None)


@functools.cache
def _two_launch_stages() -> tuple[list[int], int]:
    """The reference tokens of every variant below (eager, slices off), once per process."""
    return _greedy(True, False)


@pytest.mark.parametrize("route, config, fold", [
    (False, None, False), (True, None, False), (True, (32, 32, 1024, 8, 1), False), (True, (32, 32, 1024, 8, 8), False),
    (True, (16, 32, 512, 4, 3), False), (True, (16, 64, 512, 4, 3), False), (True, None, True),
    (True, (32, 32, 1024, 8, 1), True)],
    ids=["routing", "routing-in-slices", "routing-in-slices-one-ahead", "routing-in-slices-stages8",
         "routing-in-slices-16w4-stages3", "routing-in-slices-16w4k64-stages3", "router-fold", "router-fold-one-ahead"])
def test_slices_decode_equals_the_two_launch_stages_in_graphs_and_eager(route, config, fold):
    """With the slices' dots in fp32 (paths.BATCH1_SLICES_HALF2 off: the same sums as the stages in another fp32
    order; test_slices_half2_decode has the shipped packed-fp16 dots). ``routing-in-slices``: the slices find the top-k themselves (paths.BATCH1_SLICES_ROUTE) and the norm-route
    launch has no last arriver; the router's arrival counter must stay zero. The shipped sm80+ config pipelines the gate/up
    loop by Triton (stages 3); ``-one-ahead``: the pre-Ampere loop (the next tile in registers) on this card,
    ``-stages8``: 8 deep (the same arithmetic in the same order, so the same tokens); ``16w4``: BLOCK_I 16 on 4
    warps (``k64``: BLOCK_K8 64), the decode12 A/B's balanced configs. ``router-fold``: no norm-route launch
    (paths.BATCH1_ROUTER_FOLD: the router's sums from o_proj, the slices normalising their input), the same tokens
    (the logits agree within one fp16 rounding; the tiny coder's greedy steps route clear of such ties)."""
    from onecard.kernels import workspace

    stages, n_off = _two_launch_stages()
    eager, n_eager = _greedy(True, True, route, config=config, fold=fold, half2=False)
    graphed, n_graphed = _greedy(False, True, route, config=config, fold=fold, half2=False)
    assert n_off == 0 and n_eager > 0 and n_graphed > 0                # the path ran (captured, in graphs)
    assert eager == stages
    assert graphed == eager
    cnt = workspace.counters(torch.device("cuda", torch.cuda.current_device()), "router", 1)
    assert int(cnt.abs().sum()) == 0                                      # the zero invariant (workspace.py)


def test_slices_under_emulated_sm70():
    """The same comparison with every path decision on sm70's branch (ONECARD_EMULATE_CC=70: no PDL, the V100's
    tiles around the slices), in a fresh process (the capability is read once per process); the fp32 dots equal the
    stages, the shipped packed-fp16 dots (pre-Ampere loop, router fold) agree on >= 3/4 of the prefix."""
    import json
    import os
    import subprocess

    from bench.gpu_checks import agreement  # the matched-prefix fraction

    root = Path(__file__).resolve().parents[2]
    code = ("import json; from tests.gpu.test_moe_slices_gpu import _greedy; "
            "print(json.dumps([_greedy(True, False), _greedy(True, True, half2=False), "
            "_greedy(False, True, True, half2=False), _greedy(False, True, True, fold=True, half2=False), "
            "_greedy(False, True, True, fold=True)]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, ONECARD_EMULATE_CC="70", PYTHONPATH=str(root)), check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    (stages, n_off), (eager, n_eager), (graphed, n_graphed), (folded, n_folded), (h2, n_h2) = json.loads(
        r.stdout.strip().splitlines()[-1])
    assert n_off == 0 and n_eager > 0 and n_graphed > 0 and n_folded > 0 and n_h2 > 0
    assert eager == stages and graphed == eager and folded == eager
    assert agreement([h2], [stages]) >= 0.75, (h2, stages)          # the packed-fp16 dots, as shipped


@pytest.mark.parametrize("route, config, fold", [(True, None, False), (True, None, True), (True, (32, 32, 1024, 8, 1), True)],
                         ids=["half2", "half2-router-fold", "half2-router-fold-one-ahead"])
def test_slices_half2_decode(route, config, fold):
    """The slices' gate/up and down dots in packed fp16, as shipped (paths.BATCH1_SLICES_HALF2: four fp16 products to
    a sum, h rounded to fp16), on the shipped loop and the pre-Ampere one: graphs = eager (the same kernel); against
    the two-launch stages (fp32 dots) the greedy text agrees on at least 3/4 of its prefix (bench/gpu_checks'
    criterion: a changed rounding may flip a near tie; a wrong pairing of nibbles and inputs derails at once)."""
    from bench.gpu_checks import agreement  # the matched-prefix fraction

    stages, _ = _two_launch_stages()
    eager, n_eager = _greedy(True, True, route, config=config, fold=fold)
    graphed, n_graphed = _greedy(False, True, route, config=config, fold=fold)
    assert n_eager > 0 and n_graphed > 0
    assert graphed == eager
    assert agreement([eager], [stages]) >= 0.75, (eager, stages)
