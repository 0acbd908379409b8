"""Decode speed at the context lengths coding agents run (issue 25 item 3), against the bandwidth floor.

Scenarios (batch, context tokens per sequence): (1, 512), (1, 32768), (1, 65536), (16, 512), (16, 8192); the
512-token ones in the same process give the ratios the issue's targets are written in (32k at batch 1 >= 85%
of the 512 figure, 8k at batch 16 >= 80%). Each scenario: the contexts are prefilled once (chunked, prefix
caching on), then DECODE_REPEATS runs of ``new`` greedy tokens re-send the same prompts: the prefix cache
serves every full block, so a run is the decode of ``new`` tokens at that context (plus one short prefill).
TPOT = (last token - first token) / (new - 1); the median of the repeats is reported with min and max.
Floor: bytes one step reads (bench/full_size.step_bytes: weights of the step, 2.1 GB at batch 1, plus every
sequence's KV, 98,304 B per token) over the device's copy bandwidth; ``floor_fraction`` = floor / TPOT.

Usage (repo root, a GPU, the checkpoint of ``python bench/full_size.py build /tmp/q30``):
  python bench/long_context.py /tmp/q30 OUT.json
  ONECARD_EMULATE_CC=70 python bench/long_context.py /tmp/q30 OUT.json   # the pre-sm80 branches on this card
On the CPU (a smoke run of the same code with tiny contexts, no floor):
  python bench/long_context.py --cpu onecard/data/onecard-tiny-coder OUT.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from full_size import DECODE_REPEATS, KV_BYTES_PER_TOKEN, V, capability_record, copy_bandwidth, step_bytes

SCENARIOS = ((1, 512), (1, 32768), (1, 65536), (16, 512), (16, 8192))
CPU_SCENARIOS = ((1, 48), (1, 160), (4, 48), (4, 96))
NEW_TOKENS = 128


def engine(model_dir: str, max_ctx: int, cpu: bool):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    if cpu:
        args = {"model": model_dir, "device": "cpu", "max_model_len": max_ctx + 64, "max_num_seqs": 16,
                "max_num_batched_tokens": 512, "enable_prefix_caching": True}
    else:
        # 65,536 tokens of context plus the decoded ones; chunked prefill of 8,192 per step (the deployment's)
        args = {"model": model_dir, "quantization": "gptq", "dtype": "float16", "max_model_len": max_ctx + 1024,
                "max_num_seqs": 16, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9,
                "enable_prefix_caching": True}
    return EngineCore(EngineArgs(**args).create_config())


def run(core, prompts: list[list[int]], new: int) -> list[list[float]]:
    """Greedy ``new`` tokens for each prompt; each request's token arrival times (s after adding)."""
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        ids.append(f"lc{time.time_ns()}-{i}")
        core.add_request(EngineRequest(ids[-1], p, sp, time.monotonic(), []))
    times: dict[str, list[float]] = {}
    cuda = core.runner.device.type == "cuda"
    while core.has_unfinished():
        outs = core.step()
        if cuda and not core.async_scheduling:
            torch.cuda.synchronize()
        now = time.perf_counter() - t0
        for o in outs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
    return [times[i] for i in ids]


def tpot(times: list[list[float]]) -> float:
    """Seconds per decode step once every sequence is decoding: from the last first token to the last token."""
    first = max(t[0] for t in times)
    last = max(t[-1] for t in times)
    steps = max(len(t) for t in times) - 1
    return (last - first) / max(steps, 1)


def scenario(core, bs: int, ctx: int, new: int, vocab: int, bw: float | None, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (ctx,), generator=g).tolist() for _ in range(bs)]
    t0 = time.perf_counter()
    run(core, prompts, 2)                                                 # prefill once: the prefix cache keeps it
    prefill_s = time.perf_counter() - t0
    runs = [tpot(run(core, prompts, new)) for _ in range(DECODE_REPEATS)]
    med = statistics.median(runs)
    res = {"batch": bs, "context": ctx, "new_tokens": new, "first_prefill_s": prefill_s,
           "tpot_ms": med * 1e3, "tok_s": bs / med, "tok_s_min": bs / max(runs), "tok_s_max": bs / min(runs),
           "kv_gb_per_step": bs * ctx * KV_BYTES_PER_TOKEN / 1e9}
    if bw is not None:
        b = step_bytes(bs, ctx + new // 2)                                # the context grows during the run
        res.update(bytes_per_step_gb=b / 1e9, floor_ms=b / bw * 1e3, floor_tok_s=bs * bw / b,
                   floor_fraction=(b / bw) / med)
    return res


def main(argv: list[str]) -> dict:
    cpu = "--cpu" in argv
    model_dir, out = [a for a in argv if a != "--cpu"][:2]
    scen = CPU_SCENARIOS if cpu else SCENARIOS
    new = 8 if cpu else NEW_TOKENS
    t0 = time.perf_counter()
    core = engine(model_dir, max(c for _, c in scen), cpu)
    vocab = int(core.config.model.hf_config.get("vocab_size", V))
    res: dict = {"paths": None if cpu else capability_record(), "ready_s": time.perf_counter() - t0,
                 "kv_tokens": core.info.kv_capacity_tokens}
    bw = None if cpu else copy_bandwidth()
    res["copy_bandwidth_tb_s"] = None if bw is None else bw / 1e12
    rows = []
    for i, (bs, ctx) in enumerate(scen):
        r = scenario(core, bs, ctx, new, vocab, bw, seed=100 + i)
        rows.append(r)
        print(json.dumps(r), flush=True)
    base = {r["batch"]: r["tok_s"] for r in rows if r["context"] == min(c for b, c in scen if b == r["batch"])}
    for r in rows:
        r["fraction_of_short_context"] = r["tok_s"] / base[r["batch"]]
    res["scenarios"] = rows
    res["wall_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(res, indent=1))
    for r in rows:
        floor = f"floor {r['floor_ms']:.3f} ms ({100 * r['floor_fraction']:.0f}% of it)" if "floor_ms" in r else ""
        print(f"bs {r['batch']:2d} ctx {r['context']:6d}: {r['tok_s']:9.1f} tok/s (TPOT {r['tpot_ms']:.3f} ms, "
              f"{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}; {100 * r['fraction_of_short_context']:.0f}% of the "
              f"shortest context) {floor}")
    return res


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
