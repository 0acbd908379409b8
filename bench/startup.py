"""One engine start-up, measured: time to ready, the precompile summary, and every Triton kernel the engine
process JIT-compiled itself (a cache miss) during start-up and during a workload of varied shapes afterwards
(each such miss is a ~1 s stall of a live request).

Usage (on the GPU, repo root): python bench/startup.py MODEL_DIR OUT.jsonl [label]
Run it with a fresh TRITON_CACHE_DIR for a cold start, again with the same one for a warm start, and with
ONECARD_PRECOMPILE=0 for the JIT-at-first-launch baseline (bench/run_h200.sh part "startup" does all three).
Appends one JSON line to OUT.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.full_size import V, _engine, _run

PHASE = {"name": "startup"}
MISSES: list[dict] = []


def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
    if not cache_hit:
        MISSES.append({"phase": PHASE["name"], "kernel": getattr(src, "name", str(src))[:60]})


def count_launcher_builds() -> None:
    """Triton gcc-builds a C launcher per kernel signature at its first launch (cached on disk): count the
    builds the engine process does itself."""
    from triton.runtime import build

    real = build._build

    def counted(name, *a, **k):
        if name == "__triton_launcher":
            LAUNCHERS[PHASE["name"]] = LAUNCHERS.get(PHASE["name"], 0) + 1
        return real(name, *a, **k)

    build._build = counted


LAUNCHERS: dict[str, int] = {}


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    label = sys.argv[3] if len(sys.argv) > 3 else "run"
    triton.knobs.compilation.listener = listener
    count_launcher_builds()
    t0 = time.perf_counter()
    core, ready = _engine(model_dir)
    res = {"label": label, "time_to_ready_s": ready, "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
           "precompile": getattr(core.runner, "precompile_summary", None),
           "startup_jit_misses": len(MISSES)}
    PHASE["name"] = "workload"
    g = torch.Generator().manual_seed(2)
    t1 = time.perf_counter()
    for n in (1, 5, 16, 17, 100, 300, 2000, 4097):                         # one prompt at a time
        _run(core, [torch.randint(0, V, (n,), generator=g).tolist()], 4)
    _run(core, [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 40, 700)], 6)
    _run(core, [torch.randint(0, V, (64 + i,), generator=g).tolist() for i in range(16)], 8)
    res["workload_s"] = time.perf_counter() - t1
    res["workload_jit_misses"] = len(MISSES) - res["startup_jit_misses"]
    res["launcher_builds"] = dict(LAUNCHERS)
    res["missed_kernels"] = sorted({f"{m['phase']}:{m['kernel']}" for m in MISSES})
    res["wall_s"] = time.perf_counter() - t0
    with open(out, "a") as f:
        f.write(json.dumps(res) + "\n")
    p = res["precompile"] or {}
    print(f"[{label}] ready {ready:.1f} s; precompile: {p.get('compiled')} of {p.get('kernels')} variants "
          f"compiled in {p.get('total_seconds', 0):.1f} s on {p.get('workers')} workers "
          f"(dry {p.get('dry_seconds', 0):.1f} s, errors {len(p.get('errors', []))}); JIT misses: start-up "
          f"{res['startup_jit_misses']}, workload {res['workload_jit_misses']} ({res['workload_s']:.1f} s); "
          f"launcher builds in the engine process {res['launcher_builds']}",
          flush=True)
    for m in res["missed_kernels"][:40]:
        print("   miss", m)


if __name__ == "__main__":
    main()
