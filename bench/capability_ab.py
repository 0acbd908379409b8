"""Issue 29's bisect: why decode looked 1.2-1.4x faster when torch reported sm80 (shared/leads/capability_ab.py).

Hypothesis tested here: the lead measured decode as bs*128 / (t(prompt + 129 tokens) - t(prompt + 1 token)),
the subtraction assuming both runs pay the same prefill. The first run of a new prompt set also pays one-time
costs of the prefill path (per-shape library work); with torch answering 8.x the prefill MoE takes the fp16
grouped GEMM (a host loop of per-expert cuBLAS calls, one new GEMM shape per expert) instead of the bf16
CUTLASS one, so t1 carries a larger one-time cost and the difference shrinks: decode looks faster.

Each measurement here (bench/capability_bisect.measure, which bisects the capability's consumers one at a
time in one process; this script keeps the lead's process-wide patch, applied before onecard is imported)
reports, on the same engine and prompts, three decode figures:
  naive   = bs*128 / (t2 - t1_first)   the lead's method (t1 is the first run of these prompts)
  warmed  = bs*128 / (t2 - t1_again)   the same with t1 repeated after t2 (no first-time costs)
  arrival = bs / TPOT                  token arrival times, first to last (bench/full_size.py's method)
and prefill 4k timed on its first and on a repeated run.

Usage (repo root, on the GPU, after ``python bench/full_size.py build DIR``):
  python bench/capability_ab.py DIR OUT.json                 native; the prefill-path patches are toggled on
                                                              the same engine: gemm_fp16 (grouped GEMM in fp16,
                                                              what torch-reports-8.0 selects), per_expert (one
                                                              cuBLAS GEMM per expert, what 7.x selects)
  python bench/capability_ab.py DIR OUT.json --emulate 80    torch and onecard report sm80 (as the lead did)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

args = sys.argv[1:]
CC = int(args[args.index("--emulate") + 1]) if "--emulate" in args else None
if CC is not None:   # the lead's patches: Triton keeps the real target, torch and onecard answer CC
    from triton.runtime import driver

    _target = driver.active.get_current_target()
    driver.active.get_current_target = lambda: _target
    _real_props = torch.cuda.get_device_properties

    class _Props:
        major, minor = CC // 10, CC % 10

        def __init__(self, p):
            self._p = p

        def __getattr__(self, k):
            return getattr(self._p, k)

    torch.cuda.get_device_capability = lambda *a, **k: (CC // 10, CC % 10)
    torch.cuda.get_device_properties = lambda *a, **k: _Props(_real_props(*a, **k))

from bench.capability_bisect import measure
from bench.full_size import V, _engine, _run
from onecard.kernels.fused_moe import grouped


def main(model_dir: str, out: str) -> None:
    core, ready = _engine(model_dir)
    g = torch.Generator().manual_seed(7)
    _run(core, [torch.randint(0, V, (64,), generator=g).tolist()], 8)      # warm-up, as the lead
    res: dict = {"emulate": CC, "time_to_ready_s": ready, "runs": []}
    real_dtype, real_per_expert = grouped._gemm_dtype, grouped.per_expert
    labels = [f"emu{CC}"] * 3 if CC else ["native", "gemm_fp16", "per_expert"] * 2 + ["native"]
    for label in labels:
        grouped._gemm_dtype = (lambda x: x.dtype) if label == "gemm_fp16" else real_dtype
        grouped.per_expert = (lambda d: True) if label == "per_expert" else real_per_expert
        t = time.perf_counter()
        r = measure(core, g)
        r["label"], r["wall_s"] = label, time.perf_counter() - t
        res["runs"].append(r)
        print(json.dumps(r), flush=True)
    Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    if len(args) < 2:
        raise SystemExit(__doc__)
    main(args[0], args[1])
