"""GPU-only: after the start-up precompile the engine JIT-compiles nothing itself (also with --speculative-config,
whose verify graphs launch more shapes), and the dry pass changes no token (greedy output equals a start-up
without it). Each start runs in a fresh process with a fresh
TRITON_CACHE_DIR (cold, as on a new machine)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
CASE = Path(__file__).with_name("precompile_case.py")


def _start(ckpt: Path, cache: Path, precompile: bool, mode: str | None = None) -> dict:
    """``mode``: precompile_case.py's (None, "spec", "long" or "slices")."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), ONECARD_PRECOMPILE="1" if precompile else "0")
    out = subprocess.run([sys.executable, str(CASE), str(ckpt)] + ([mode] if mode else []), env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["miss_lines"] = [line for line in out.stderr.splitlines() if line.startswith("miss ")]
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precompile_leaves_nothing_to_jit(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from tests.fixtures import checkpoints

    tok = checkpoints.build_tokenizer(tmp_path / "tok")
    ckpt = checkpoints.build_moe_gptq(tmp_path / "moe_gptq", checkpoints.build_moe(tmp_path / "moe", tok))
    with_pc = _start(ckpt, tmp_path / "cache_a", True)
    without = _start(ckpt, tmp_path / "cache_b", False)
    assert with_pc["misses"] == [], with_pc["miss_lines"]
    assert len(without["misses"]) >= 5          # the check can fail: the plain JIT compiles at first launch
    assert with_pc["tokens"] == without["tokens"]
    # with --speculative-config the verify graphs' shapes are precompiled too (their capture launches each one),
    # and greedy output is the same
    spec = _start(ckpt, tmp_path / "cache_c", True, mode="spec")
    assert spec["misses"] == [], spec["miss_lines"]
    assert spec["tokens"] == with_pc["tokens"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precompile_covers_the_split_kv_decode_graphs(tmp_path):
    """With a bound whose decode graphs split their KV (the bundled coder at 2,048 positions: split-KV attention
    and its reduce launch), the precompile still leaves nothing to JIT, and the greedy tokens are those of a
    start-up without it."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from bench.gpu_checks import CODER

    with_pc = _start(CODER, tmp_path / "cache_a", True, mode="long")
    assert with_pc["misses"] == [], with_pc["miss_lines"]
    without = _start(CODER, tmp_path / "cache_b", False, mode="long")
    assert any("reduce" in m for m in without["misses"]), without["misses"]     # the split did run
    assert len(without["misses"]) >= 5 and with_pc["tokens"] == without["tokens"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precompile_covers_the_moe_slices(tmp_path):
    """With the batch-1 MoE's expert stages in one launch (kernels/paths.BATCH1_MOE_SLICES), the precompile's dry
    run records the slices kernel too: nothing left to JIT, the same greedy tokens as a start-up without it."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from bench.gpu_checks import CODER

    with_pc = _start(CODER, tmp_path / "cache_a", True, mode="slices")
    assert with_pc["misses"] == [], with_pc["miss_lines"]
    without = _start(CODER, tmp_path / "cache_b", False, mode="slices")
    assert any("slices" in m for m in without["misses"]), without["misses"]     # the kernel did run
    assert with_pc["tokens"] == without["tokens"]
