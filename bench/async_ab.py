"""Async scheduling A/B on one engine: decode tok/s with the synchronous loop and with ``--async-scheduling``.

Usage (on the H200, repo root, after ``python bench/full_size.py build DIR``):
  python bench/async_ab.py DIR OUT.json
One EngineCore over the full-size checkpoint, built with async scheduling (so its CUDA-graph runner guards its
pinned input buffers); the loop is switched per run, alternating sync and async, REPEATS times per batch size
(prompt 512, 256 new tokens, ignore_eos, as full_size.py), and the median of each is reported with min/max.
The same prompts must give the same greedy tokens in both modes (checked and reported).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.full_size import V, _engine, _run

REPEATS = 3


def main(model_dir: str, out: str) -> dict:
    core, ready = _engine(model_dir, async_scheduling=True)
    assert core.async_scheduling
    res: dict = {"time_to_ready_s": ready}
    g = torch.Generator().manual_seed(1)
    _run(core, [torch.randint(0, V, (64,), generator=g).tolist()], 8)         # warm-up
    for bs in (1, 16):
        prompts = [torch.randint(0, V, (512,), generator=g).tolist() for _ in range(bs)]
        tpots: dict[str, list[float]] = {"sync": [], "async": []}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(REPEATS):
            for mode in ("sync", "async"):
                core.async_scheduling = mode == "async"
                got: dict[str, list[int]] = {}
                times = _run(core, prompts, 256, got)
                first = max(t[0] for t in times.values())
                last = max(t[-1] for t in times.values())
                tpots[mode].append((last - first) / 255)
                tokens.setdefault(mode, [got[k] for k in sorted(got, key=lambda k: int(k.rsplit("-", 1)[1]))])
        for mode, v in tpots.items():
            med = sorted(v)[len(v) // 2]
            res[f"decode_bs{bs}_{mode}_tok_s"] = bs / med
            res[f"decode_bs{bs}_{mode}_tpot_ms"] = med * 1e3
            res[f"decode_bs{bs}_{mode}_tok_s_min"] = bs / max(v)
            res[f"decode_bs{bs}_{mode}_tok_s_max"] = bs / min(v)
        res[f"decode_bs{bs}_same_tokens"] = tokens["sync"] == tokens["async"]
    core.async_scheduling = True
    Path(out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:32s} {v:10.2f}" if isinstance(v, float) else f"{k:32s} {v}", flush=True)
    return res


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
