"""TTFT of a long prompt computed cold vs served from the host KV tier (issue 23; target: >= 5x faster).

Usage (on the GPU machine, repo root, after ``python bench/full_size.py build /tmp/q30``):
  python bench/host_tier.py /tmp/q30 $OUT/host_tier.json [--prompt-tokens 32768] [--offload-gib 16]
One EngineCore over the full-size checkpoint with prefix caching, ``--kv-offloading-size`` and a KV pool of just
``--max-model-len`` tokens (so two other long prompts evict a prompt's blocks from the GPU entirely). Steps: a
short warm-up; prompt A cold (TTFT = time to its first token); prompts B and C cold (A's blocks go to the host
tier); A again: its prefix comes back from host memory (TTFT); A once more: a plain GPU prefix hit (TTFT). Each
request generates 8 greedy tokens; A's tokens must be the same all three times. Reports the TTFTs, the speed-up,
the bytes copied each way, the host tier's allocation time and the engine's counters. On a machine without a
GPU it runs the same sequence on the CPU (``--device cpu`` with a tiny checkpoint and a short prompt: a smoke test
of the script, no timing claim).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK = 16
NEW_TOKENS = 8


def _run(core, rid: str, prompt: list[int]) -> tuple[float, list[int]]:
    """(seconds to the first token, the tokens) of one request run alone."""
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    assert core.add_request(EngineRequest(rid, prompt, sp, time.monotonic(), [])) is None
    ttft, tokens = None, []
    while core.has_unfinished():
        outs = core.step()
        for o in outs:
            if o.error:
                raise RuntimeError(o.error)
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += o.new_token_ids
    return ttft, tokens


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--offload-gib", type=float, default=16.0)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    a = ap.parse_args(argv)

    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    n = a.prompt_tokens
    max_len = -(-(n + NEW_TOKENS) // BLOCK) * BLOCK
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kw = {"model": a.model_dir, "max_model_len": max_len, "max_num_seqs": 16, "max_num_batched_tokens": 8192,
          "enable_prefix_caching": True, "kv_offloading_size": a.offload_gib, "device": device,
          "num_gpu_blocks_override": 1 + max_len // BLOCK}          # one max_model_len sequence, block 0 reserved
    if device == "cuda":
        kw.update(quantization="gptq", dtype="float16", gpu_memory_utilization=0.9)
    t0 = time.perf_counter()
    core = EngineCore(EngineArgs(**kw).create_config())
    ready = time.perf_counter() - t0
    vocab = int(core.config.model.hf_config["vocab_size"])
    g = torch.Generator().manual_seed(5)
    prompt_a, prompt_b, prompt_c = (torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(3))
    res: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "prompt_tokens": n,
                 "max_model_len": max_len, "gpu_kv_tokens": core.info.kv_capacity_tokens,
                 "host_tier_blocks": core.info.num_host_blocks, "offload_gib": a.offload_gib,
                 "time_to_ready_s": ready}
    _run(core, "warmup", torch.randint(0, vocab, (min(n, 512),), generator=g).tolist())
    res["ttft_cold_s"], cold = _run(core, "a-cold", prompt_a)
    res["ttft_cold_b_s"], _ = _run(core, "b-cold", prompt_b)
    _run(core, "c-cold", prompt_c)
    kv = core.scheduler.kv_cache_manager
    s0 = core.stats()
    res["ttft_host_tier_s"], from_host = _run(core, "a-host", prompt_a)
    s1 = core.stats()
    res["ttft_gpu_prefix_hit_s"], from_gpu = _run(core, "a-gpu", prompt_a)
    res["host_hit_tokens"] = s1.external_prefix_cache_hits - s0.external_prefix_cache_hits
    res["bytes_to_host_total"] = s1.kv_bytes_to_host
    res["bytes_from_host_for_a"] = s1.kv_bytes_from_host - s0.kv_bytes_from_host
    res["host_tier_usage"] = s1.host_kv_cache_usage
    res["same_tokens"] = cold == from_host == from_gpu
    res["speedup_host_vs_cold"] = res["ttft_cold_s"] / res["ttft_host_tier_s"]
    res["speedup_gpu_hit_vs_cold"] = res["ttft_cold_s"] / res["ttft_gpu_prefix_hit_s"]
    res["host_to_gpu_gb_s_upper_bound"] = res["bytes_from_host_for_a"] / res["ttft_host_tier_s"] / 1e9
    res["target_5x_met"] = res["speedup_host_vs_cold"] >= 5
    assert kv.num_free_blocks == kv.num_usable_blocks, "KV blocks leaked"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:32s} {v:10.4f}" if isinstance(v, float) else f"{k:32s} {v}", flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
