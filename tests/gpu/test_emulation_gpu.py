"""GPU-only: the pre-sm80 code paths (what a V100 runs) on this card, through ONECARD_EMULATE_CC=70: every
kernel-path decision (kernels/paths.py: cuBLAS prefill from 65 rows, per-expert MoE, the spill-free tiles,
no PDL, fp16 grouped GEMMs, the dtype rules, SDPA's attention for prefill chunks of more than 16 tokens) takes
sm70's branch while Triton compiles for the real card.

Each case runs in a fresh process with the variable set (the capability is read once per process):
  * the tiny checkpoints' greedy text, Triton vs reference, CUDA graphs vs eager, async vs sync
    (bench/gpu_checks.py, the same criteria as test_engine_gpu);
  * the full-size logits check, Triton vs reference (bench/full_size.py logits), when the full-size checkpoint
    exists (ONECARD_FULL_SIZE_CKPT, default /tmp/q30: ``python bench/full_size.py build /tmp/q30``).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.test_engine_gpu import check_results

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FULL = Path(os.environ.get("ONECARD_FULL_SIZE_CKPT", "/tmp/q30"))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(args: list[str], out: Path, cc: str = "70", timeout: int = 900) -> dict:
    env = dict(os.environ, ONECARD_EMULATE_CC=cc, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, *args, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@needs_gpu
def test_tiny_checkpoints_greedy_under_emulated_sm70(tmp_path):
    res = _run(["bench/gpu_checks.py"], tmp_path / "checks.json")
    rec = res["_paths"]
    assert rec["capability"] == rec["emulated"] == 70 and rec["real_capability"] >= 70, rec
    check_results(res)


@needs_gpu
@pytest.mark.skipif(not (FULL / "config.json").exists(), reason=f"no full-size checkpoint at {FULL}")
def test_full_size_logits_under_emulated_sm70(tmp_path):
    res = _run(["bench/full_size.py", "logits", str(FULL)], tmp_path / "logits.json")
    assert res["paths"]["capability"] == 70, res["paths"]
    # today's tolerance of the native path (BENCHMARKS.md: rel err 3.5e-4 to 4.5e-4, argmax 100%) with room
    # for the other summation orders of the sm70 tiles and the fp16 per-expert GEMMs
    # 16 tokens (the kernel's prefill tiles) and 80 (the chunk on SDPA's memory-efficient kernel: paths.prefill_sdpa)
    for suffix in ("", "_80"):
        assert res["logits_rel_err_triton_vs_ref" + suffix] < 1e-3, res
        assert res["argmax_agreement" + suffix] >= 0.99, res
