"""GPU-only: decode CUDA graphs per context class (kernels/paths.decode_graph_bounds, DECODE_CONTEXT_GRAPHS).

With the classes on, a decode step whose sequences are all shorter than SPLIT_MIN_SEQ_LEN replays the unsplit
graph: the same launches as an eager decode at that context (no split below the threshold there either), so its
greedy tokens must equal eager's token for token, at batch 1 (the batch-1 attention block's own paths) and
batch 3; and a step past the class replays the max_model_len graph. With the fused reduce on too
(paths.ATTN_FUSED_REDUCE), the short class splits and its launches merge their own segments, eager's as well: the
tokens must still be equal, and the arrival counters back at zero. The bundled tiny coder (GPTQ g128, 4,096
positions) in fp16."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
MAX_LEN = 4096


def _greedy(eager: bool, lens: list[int], new: int):
    from bench.gpu_checks import CODER
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    cfg = EngineArgs(model=str(CODER), device="cuda", dtype="float16", max_model_len=MAX_LEN, enforce_eager=eager,
                     kv_cache_memory_bytes=256 << 20, max_num_seqs=4).create_config()
    core = EngineCore(cfg)
    vocab = int(cfg.model.hf_config["vocab_size"])
    g = torch.Generator().manual_seed(11)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, n in enumerate(lens):
        core.add_request(EngineRequest(str(i), torch.randint(3, vocab, (n,), generator=g).tolist(), sp,
                                       time.monotonic(), []))
    got: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    graphs = core.runner.graphs
    return [got[str(i)] for i in range(len(lens))], (dict(graphs.decode_replays) if graphs is not None else None)


@pytest.mark.parametrize("fused", [False, True], ids=["reduce", "fused"])
@pytest.mark.parametrize("lens", [[700], [300, 650, 120]], ids=["bs1", "bs3"])
def test_short_context_graph_replays_the_eager_launches(lens, fused):
    from onecard.kernels import paths, workspace

    paths.set_switch("decode_context_graphs", True)
    paths.set_switch("attention_fused_reduce", fused)
    try:
        short = paths.SPLIT_MIN_SEQ_LEN - 1
        eager, _ = _greedy(True, lens, 24)
        graphed, replays = _greedy(False, lens, 24)
        assert graphed == eager
        assert replays and all(bound == short for (_, bound) in replays), replays
        dev = torch.device("cuda", torch.cuda.current_device())        # the kernels' key: str(q.device)
        cnt = workspace.counters(dev, "attention", workspace.REGION_SIZE)
        assert int(cnt.abs().sum()) == 0                                  # the zero invariant (workspace.py)
    finally:
        paths.set_switch("decode_context_graphs", None)
        paths.set_switch("attention_fused_reduce", None)


def test_a_step_past_the_class_replays_the_max_model_len_graph():
    from onecard.kernels import paths

    paths.set_switch("decode_context_graphs", True)
    try:
        short = paths.SPLIT_MIN_SEQ_LEN - 1
        _, replays = _greedy(False, [short - 8], 24)                     # crosses the bound after 8 tokens
        assert replays.get((1, short), 0) > 0 and replays.get((1, MAX_LEN), 0) > 0, replays
    finally:
        paths.set_switch("decode_context_graphs", None)
