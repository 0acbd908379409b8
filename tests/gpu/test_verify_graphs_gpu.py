"""GPU-only: speculative verify steps replayed from the engine's CUDA graphs (runner/cuda_graphs.py) on the tiny
GPTQ MoE checkpoint (fp16, Triton kernels): a graphed verify step (padded rows and a padded sequence) gives the
eager step's logits and greedy tokens, and greedy output with speculation on (verify graphs) equals off."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def _core(path, spec: dict | None = SPEC):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    return EngineCore(EngineArgs(model=str(path), device="cuda", dtype="float16", max_model_len=256,
                                 kv_cache_memory_bytes=64 << 20, max_num_seqs=16,
                                 speculative_config=spec).create_config())


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in (5, 17, 9)] + [[21, 22, 23] * 5]


def test_graphed_verify_step_equals_eager(tiny_moe_gptq_dir):
    from tests.engine.spec_helpers import (
        eager_and_graphed,
        verify_step_inputs,
    )

    core = _core(tiny_moe_gptq_dir)
    runner = core.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.capture_stats["verify_graphs"] == len(graphs.verify_shapes) > 0
    inputs, q = verify_step_inputs(core, _prompts()[:3])
    eager, graphed, _, _ = eager_and_graphed(runner, graphs, inputs, 4, q)
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))


def test_greedy_with_verify_graphs_equals_plain(tiny_moe_gptq_dir):
    from onecard.sampling_params import SamplingParams
    from tests.engine.spec_helpers import OracleDrafter, enable_spec, run

    prompts = _prompts()
    reqs = {f"g{i}": (p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, (24, 7, 13, 18)))}
    plain = run(_core(tiny_moe_gptq_dir, None), reqs)
    ref = {rid: list(reqs[rid][0]) + plain[rid]["tokens"] for rid in reqs}
    core = _core(tiny_moe_gptq_dir)
    spec = enable_spec(core, OracleDrafter(ref, int(core.config.model.hf_config["vocab_size"])), k=4)
    got = run(core, reqs)
    for rid in reqs:
        assert got[rid]["tokens"] == plain[rid]["tokens"], rid
    verify = {s: n for s, n in core.runner.graphs.replays.items() if s[1] > 1}
    assert sum(verify.values()) >= 3 and spec.stats().num_accepted_tokens > 0
