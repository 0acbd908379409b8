"""ONECARD_L2_PREFETCH (layers/l2_prefetch.py): the next layer's dense weights prefetched into L2 during each
decode-sized step's MLP. A prefetch changes no value, so greedy decoding must write the same tokens with the
switch on and off. On the CPU there is no side stream: the prefetch op runs in place (the reference backend's
no-op here; the interpreter's walk in tests/kernels/test_l2_prefetch.py), so these tests run the model's whole
prefetch path — switch read from the environment, tables built after the weights are placed, one prefetch per
layer but the last in each decode-sized forward, none in prefills over the threshold — and check what it did.
"""
from __future__ import annotations

import time

import pytest
import torch

from onecard.config import ConfigError, EngineArgs, Env
from onecard.core.engine_core import EngineCore
from onecard.kernels import paths
from onecard.kernels.prefetch.table import tensor_span
from onecard.layers.l2_prefetch import L2Prefetcher
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams

NEW = 10                                  # tokens per request


def _greedy(path, monkeypatch, mode: str | None, new: int = NEW) -> tuple[list[list[int]], EngineCore]:
    if mode is None:
        monkeypatch.delenv("ONECARD_L2_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("ONECARD_L2_PREFETCH", mode)
    core = EngineCore(EngineArgs(model=str(path), device="cpu", max_model_len=192).create_config())
    g = torch.Generator().manual_seed(7)
    # a prompt over the threshold (its prefill: no prefetch), short ones, one at a time and together
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (paths.L2_PREFETCH_MAX_TOKENS + 9, 3, 11)]
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(str(i), p, sp, time.monotonic(), []))
    got: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[str(i)] for i in range(len(prompts))], core


@pytest.mark.parametrize("fixture", ["tiny_moe_gptq_dir", "tiny_dense_dir"])
def test_greedy_tokens_identical_with_prefetch_on_and_off(fixture, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    off, core_off = _greedy(path, monkeypatch, None)
    assert core_off.runner.model.l2_prefetch is None                 # default: off, nothing built
    for mode, want in (("1", "l2"), ("evict_last", "evict_last")):
        calls: list[int] = []
        orig = L2Prefetcher.start

        def spy(self, layer, _orig=orig, _calls=calls):             # counts, then runs the real start()
            _calls.append(layer)
            return _orig(self, layer)
        with monkeypatch.context() as m:
            m.setattr(L2Prefetcher, "start", spy)
            on, core = _greedy(path, monkeypatch, mode)
        pf = core.runner.model.l2_prefetch
        assert pf is not None and pf.enabled and pf.mode == want
        assert on == off, (mode, on, off)
        layers = core.runner.model.num_layers
        # the three prompts prefill in one step over the threshold (no prefetch), then decode together for
        # new - 1 steps of 3 tokens: each of those prefetched layers 1..L-1 in order (layer l's MLP -> l + 1)
        assert calls == list(range(1, layers)) * (NEW - 1)


def _covered(rows: list[tuple[int, int]], addr: int, n: int) -> bool:
    """Is every byte of [addr, addr + n) in some row?"""
    pos = addr
    for a, m in sorted(rows):
        if a <= pos < a + m:
            pos = a + m
    return pos >= addr + n


def test_tables_hold_each_layers_dense_weights(tiny_moe_gptq_dir, monkeypatch):
    """Layer i's table: its norms, q/k/v, o_proj and router bytes (qkv first, no expert), nothing else."""
    monkeypatch.setenv("ONECARD_L2_PREFETCH", "on")
    core = EngineCore(EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu", max_model_len=64).create_config())
    model = core.runner.model
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        qkv = [a.qkv_proj] if a.fuse_qkv else [a.q_proj, a.k_proj, a.v_proj]
        gptq = [w for lin in qkv + [a.o_proj] for w in (lin.gptq.qweight, lin.gptq.scales, lin.gptq.qzeros)]
        want = [layer.input_layernorm, a.q_norm, a.k_norm, layer.post_attention_layernorm, layer.mlp.gate] + gptq
        rows = [tuple(r) for r in model.l2_prefetch.tables[i].tolist()]
        assert all(_covered(rows, *tensor_span(t)) for t in want)
        spans = {tensor_span(t) for t in want} | {tensor_span(lin.gptq.g_idx) for lin in qkv + [a.o_proj]
                                                  if lin.gptq.g_idx is not None}
        assert sum(n for _, n in rows) == sum(n for _, n in spans)   # nothing else (no expert weights)
        assert rows[0][0] == layer.input_layernorm.data_ptr()        # read first, prefetched first


def test_env_values():
    import os

    old = os.environ.get("ONECARD_L2_PREFETCH")
    try:
        for value, mode in (("", "off"), ("0", "off"), ("off", "off"), ("1", "l2"), ("ON", "l2"), ("l2", "l2"),
                            ("evict_last", "evict_last")):
            os.environ["ONECARD_L2_PREFETCH"] = value
            assert Env.read().l2_prefetch == mode
        os.environ["ONECARD_L2_PREFETCH"] = "sometimes"
        with pytest.raises(ConfigError, match="ONECARD_L2_PREFETCH=sometimes"):
            Env.read()
    finally:
        if old is None:
            os.environ.pop("ONECARD_L2_PREFETCH", None)
        else:
            os.environ["ONECARD_L2_PREFETCH"] = old


def test_fit_rule():
    """sm80+ where a layer takes at most a third of the L2; never on Volta/Turing; the CPU path always runs."""
    ten_mb = 10_300_000
    assert paths.l2_prefetch_fits(90, 50 << 20, ten_mb)              # H100
    assert paths.l2_prefetch_fits(80, 40 << 20, ten_mb)              # A100
    assert not paths.l2_prefetch_fits(70, 6 << 20, ten_mb)           # V100
    assert not paths.l2_prefetch_fits(70, 1 << 30, 1)                # below sm80 whatever the size
    assert not paths.l2_prefetch_fits(86, 6 << 20, ten_mb)           # GA102: 6 MB
    assert paths.l2_prefetch_fits(80, None, ten_mb)                  # not a GPU
    assert [t for t in range(40) if paths.use_l2_prefetch(t)] == list(range(1, paths.L2_PREFETCH_MAX_TOKENS + 1))


def test_bench_ab_runs_on_the_cpu(tiny_moe_gptq_dir):
    """bench/l2_prefetch.py's A/B code (modes switched on one engine, alternating runs, token check) on the CPU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import l2_prefetch as bench

    core = bench.engine(str(tiny_moe_gptq_dir), cpu=True)
    modes = bench.Modes(core)
    assert modes.prefetchers["off"] is None and modes.prefetchers["l2"].enabled
    res = bench.decode_ab(core, modes, 2, 8, 4, 200, seed=1)
    assert res["tokens_equal"] and set(res["tokens_equal_by_mode"]) == set(bench.MODES)
    assert all(res[m]["tok_s"] > 0 for m in bench.MODES)
    assert core.runner.model.l2_prefetch is None                     # left as the engine was built
