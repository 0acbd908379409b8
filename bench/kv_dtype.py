"""KV-cache dtype on the GPU: KV tokens at --gpu-memory-utilization 0.9, decode and prefill speed, per format.

Usage (GPU, repo root, after ``python bench/full_size.py build /tmp/q30``):
  python bench/kv_dtype.py /tmp/q30 $OUT/kv_dtype.json
For fp16 ("auto"), fp8_e5m2 and, on sm89+, fp8_e4m3, one fresh process each (so each engine profiles the same
free memory) builds the engine with full_size.py's flags (max_num_seqs 16, max_num_batched_tokens 8192,
utilization 0.9, CUDA graphs), then reports: KV tokens / GiB / bytes per token; the full-size logits of a
16-token prefill on the Triton path against the reference path on the same fp8 cache; decode tok/s at batch 1
and 16 (prompt 512, 256 new tokens, median of 3, as full_size.py) and at batch 16 over 4,096-token prompts
(where reading the KV cache is a larger share of each step); prefill tok/s of a 4,096-token prompt (median of 3).
The JSON has one entry per KV dtype and the fp8 / fp16 ratios. ``--one KV DIR OUT`` runs one format.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.full_size import V, _engine, _run, check_logits

REPEATS = 3


def _tpot(core, prompts: list[list[int]], new: int) -> list[float]:
    out = []
    for _ in range(REPEATS):
        times = _run(core, prompts, new)
        first = max(t[0] for t in times.values())
        last = max(t[-1] for t in times.values())
        out.append((last - first) / (new - 1))
    return sorted(out)


def one(kv: str, model_dir: str, out: str) -> dict:
    t0 = time.perf_counter()
    core, ready = _engine(model_dir, kv_cache_dtype=kv)
    info = core.info
    res: dict = {"kv_cache_dtype": info.kv_cache_dtype, "time_to_ready_s": ready, "kv_tokens": info.kv_capacity_tokens,
                 "kv_cache_gib": info.kv_cache_bytes / 2**30, "kv_bytes_per_token": info.kv_bytes_per_token,
                 "weights_gib": info.weights_bytes / 2**30, "gpu": torch.cuda.get_device_name(),
                 "cc": ".".join(map(str, torch.cuda.get_device_capability()))}
    try:
        res.update(check_logits(core))
    except Exception as e:
        res["logits_check_error"] = repr(e)
    g = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    _run(core, [prompt(64)], 8)                                               # warm-up
    for bs, ctx in ((1, 512), (16, 512), (16, 4096)):
        t = _tpot(core, [prompt(ctx) for _ in range(bs)], 256)
        key = f"decode_bs{bs}" + ("" if ctx == 512 else f"_ctx{ctx}")
        res[f"{key}_tok_s"] = bs / t[1]
        res[f"{key}_tok_s_min"], res[f"{key}_tok_s_max"] = bs / t[-1], bs / t[0]
    _run(core, [prompt(4096)], 1)
    pre = sorted(4096 / next(iter(_run(core, [prompt(4096)], 1).values()))[0] for _ in range(REPEATS))
    res["prefill_4096_tok_s"] = pre[1]
    res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["wall_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(res, indent=1))
    return res


def main(model_dir: str, out: str) -> dict:
    major, minor = torch.cuda.get_device_capability()
    kinds = ["auto", "fp8_e5m2"] + (["fp8_e4m3"] if (major, minor) >= (8, 9) else [])
    res: dict = {"gpu": torch.cuda.get_device_name(), "cc": f"{major}.{minor}", "formats": {}}
    for kv in kinds:
        part = Path(out).with_name(f"{Path(out).stem}_{kv}.json")
        proc = subprocess.run([sys.executable, __file__, "--one", kv, model_dir, str(part)], text=True,
                              capture_output=True, check=False)
        if proc.returncode != 0:
            res["formats"][kv] = {"error": proc.stderr[-3000:]}
            continue
        res["formats"][kv] = json.loads(part.read_text())
    base = res["formats"].get("auto", {})
    for kv, r in res["formats"].items():
        if kv == "auto" or "error" in r or "error" in base:
            continue
        res[f"{kv}_vs_fp16"] = {k: r[k] / base[k] for k in r
                                if (k.endswith("_tok_s") or k == "kv_tokens") and base.get(k)}
    Path(out).write_text(json.dumps(res, indent=1))
    for kv, r in res["formats"].items():
        print(f"--- {kv}")
        for k, v in r.items():
            print(f"  {k:30s} {v:12.2f}" if isinstance(v, float) else f"  {k:30s} {v}")
    for k, v in res.items():
        if k.endswith("_vs_fp16"):
            print(k, {a: round(b, 3) for a, b in v.items()})
    return res


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 3:
        main(sys.argv[1], sys.argv[2])
    else:
        raise SystemExit(__doc__)
