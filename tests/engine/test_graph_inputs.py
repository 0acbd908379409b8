"""The CUDA-graph runner's input staging (pinned host twins, one copy per buffer, block-table rows only where
they changed, padded rows) on the CPU.

CUDA graphs do not exist on the CPU, so off CUDA the graph runner re-runs the model eagerly on its static
input buffers — exactly the tensors a captured graph reads. What is under test is that those buffers hold the
step's inputs: greedy tokens through ``try_run`` must equal the eager engine's, over enough steps that block
tables grow, with batch sizes that shrink as requests finish (padding rows) and a smallest graph larger than
the batch; with async scheduling too, where each step's ids are the previous step's samples, written into the
static buffer on the device. The real replay is checked against eager on the H200 (bench/gpu_checks.py).
"""
from __future__ import annotations

import time

import pytest
import torch

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.protocol import EngineRequest
from onecard.runner.cuda_graphs import CUDAGraphRunner
from onecard.sampling_params import SamplingParams


def _run(core: EngineCore, lens: list[int], max_tokens: list[int]) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    for i, (n, m) in enumerate(zip(lens, max_tokens)):
        sp = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        core.add_request(EngineRequest(f"r{i}", torch.randint(0, 200, (n,), generator=g).tolist(), sp,
                                       time.monotonic(), []))
    got: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_staged_graph_inputs_match_eager(tiny_moe_dir, async_scheduling):
    args = dict(model=str(tiny_moe_dir), device="cpu", max_model_len=128, max_num_seqs=5)
    lens, max_tokens = [3, 20, 9, 14, 30], [40, 23, 35, 5, 18]           # finish at different steps
    eager = _run(EngineCore(EngineArgs(**args).create_config()), lens, max_tokens)

    core = EngineCore(EngineArgs(**args, async_scheduling=async_scheduling).create_config())
    assert core.async_scheduling == async_scheduling
    runner = core.runner
    sizes = [2, 4, 8]                                                    # 1 -> padded to 2; 5 -> 8
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, sizes, 128 // runner.block_size, 128, runner.device)
    graphs.capture()                                 # off CUDA: each shape runs eagerly on the static buffers
    runner.graphs = graphs
    replays, filled = [], []
    orig = graphs.try_run

    def try_run(inputs, fill=None):
        out = orig(inputs, fill)
        if out is not None:
            replays.append(inputs.seq_lens.shape[0])
            filled.append(fill is not None)
        return out

    graphs.try_run = try_run
    staged = _run(core, lens, max_tokens)
    assert staged == eager
    assert {1, 2, 3, 4, 5} <= set(replays) and len(replays) >= 38          # every batch size went through
    assert (graphs.slot_mapping[1:2] == -1).all()                        # the last step (1 request) padded row 1
    assert any(filled) == async_scheduling and (not async_scheduling or sum(filled) >= 38)
