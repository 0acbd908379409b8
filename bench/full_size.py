"""Full-size benchmark on one GPU: a Qwen3-30B-A3B-shaped GPTQ W4A16 checkpoint with random weights.

Usage (on the H200, from the repo root):
  python bench/full_size.py build DIR            # write the checkpoint (real GPTQModel on-disk format)
  python bench/full_size.py onecard DIR OUT.json # time to ready, decode bs1/bs16 (median of 3), prefill 4096, TTFT 2048, memory
  python bench/full_size.py hf OUT.json          # HF transformers bf16 (grouped_mm experts, sdpa), same shapes
  python bench/full_size.py floor OUT.json       # copy bandwidth and the bytes-per-step floor
  python bench/full_size.py logits DIR OUT.json  # the full-size logits check alone (Triton vs reference)
Every mode honours ONECARD_EMULATE_CC=70 (kernel-path decisions of another capability on this card; the JSON's
"paths" records the capability used): ``bash bench/run_h200.sh emu70`` runs ``onecard`` so. ``onecard`` also
honours BENCH_POLICY="fill+SWITCH+..." (bench/policy_switches.py, as long_context.py's policies; set before the
engine is built, recorded in the JSON): the record of a switch or config that an A/B chose, before a commit ships it.
Each prints a table; JSON goes to OUT.json. Engine measurements go through the real loader and EngineCore.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

L, H, NQ, NKV, D, E, TOPK, I, V, G = int(os.environ.get("ONECARD_BENCH_LAYERS", "48")), 2048, 32, 4, 128, 128, 8, 768, 151936, 128

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
    "num_hidden_layers": L, "num_attention_heads": NQ, "num_key_value_heads": NKV, "head_dim": D,
    "num_experts": E, "num_experts_per_tok": TOPK, "moe_intermediate_size": I, "intermediate_size": 6144,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": V,
    "max_position_embeddings": 262144, "rope_theta": 10000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "output_router_logits": False,
}
QCONFIG = {"bits": 4, "group_size": G, "desc_act": False, "sym": True, "lm_head": False,
           "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32"}
DECODE_REPEATS = 3                    # decode runs per batch size (prompt 512, 256 new tokens each)


def _gptq(prefix: str, k: int, n: int, dev: str) -> dict[str, torch.Tensor]:
    # random nibbles; v1 sym zeros 0x77777777 (true zero 8); scales so that weights have std ~ 0.02
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
    qzeros = torch.full((k // G, n // 8), 0x77777777, dtype=torch.int32, device=dev)
    scales = (torch.rand(k // G, n, device=dev) * 0.002 + 0.003).half()
    g_idx = (torch.arange(k, device=dev, dtype=torch.int32) // G)
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
            f"{prefix}.g_idx": g_idx}


def build(out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = dict(CONFIG, quantization_config=QCONFIG)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "quantize_config.json").write_text(json.dumps(QCONFIG, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    shards = 4
    per = L // shards
    weight_map: dict[str, str] = {}
    t0 = time.time()
    for s in range(shards):
        tensors: dict[str, torch.Tensor] = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = (torch.randn(V, H, device=dev) * 0.02).half()
        if s == shards - 1:
            tensors["lm_head.weight"] = (torch.randn(V, H, device=dev) * 0.02).half()
            tensors["model.norm.weight"] = torch.ones(H, device=dev).half()
        for layer in range(s * per, (s + 1) * per):
            p = f"model.layers.{layer}"
            tensors[f"{p}.input_layernorm.weight"] = torch.ones(H, device=dev).half()
            tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, device=dev).half()
            tensors[f"{p}.self_attn.q_norm.weight"] = torch.ones(D, device=dev).half()
            tensors[f"{p}.self_attn.k_norm.weight"] = torch.ones(D, device=dev).half()
            tensors.update(_gptq(f"{p}.self_attn.q_proj", H, NQ * D, dev))
            tensors.update(_gptq(f"{p}.self_attn.k_proj", H, NKV * D, dev))
            tensors.update(_gptq(f"{p}.self_attn.v_proj", H, NKV * D, dev))
            tensors.update(_gptq(f"{p}.self_attn.o_proj", NQ * D, H, dev))
            tensors[f"{p}.mlp.gate.weight"] = (torch.randn(E, H, device=dev) * 0.02).half()
            for e in range(E):
                tensors.update(_gptq(f"{p}.mlp.experts.{e}.gate_proj", H, I, dev))
                tensors.update(_gptq(f"{p}.mlp.experts.{e}.up_proj", H, I, dev))
                tensors.update(_gptq(f"{p}.mlp.experts.{e}.down_proj", I, H, dev))
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        cpu = {k: v.cpu().contiguous() for k, v in tensors.items()}
        save_file(cpu, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in cpu})
        print(f"shard {s + 1}/{shards} written ({time.time() - t0:.1f} s)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _engine(model_dir: str, **kw):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    args = {"model": model_dir, "quantization": "gptq", "dtype": "float16", "max_model_len": 8192, "max_num_seqs": 16,
            "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9, "enable_prefix_caching": False}
    args.update(kw)
    t0 = time.perf_counter()
    core = EngineCore(EngineArgs(**args).create_config())
    return core, time.perf_counter() - t0


def _run(core, prompts: list[list[int]], max_tokens: int, tokens: dict | None = None) -> dict[str, list[float]]:
    """Each request's token arrival times (s after adding); ``tokens`` (if given) collects their ids."""
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t_add = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{time.time_ns()}-{i}", p, sp, time.monotonic(), []))
    times: dict[str, list[float]] = {}
    while core.has_unfinished():
        outs = core.step()
        if not core.async_scheduling:      # (async: the outputs' ids were read; the next step is in flight)
            torch.cuda.synchronize()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).extend([now - t_add] * len(o.new_token_ids))
            if tokens is not None:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return times


def bench_onecard(model_dir: str, out: str) -> dict:
    t0 = time.perf_counter()
    policy = os.environ.get("BENCH_POLICY")
    if policy:
        from policy_switches import set_switches
        set_switches(policy)
    core, ready = _engine(model_dir, enforce_eager=os.environ.get("ONECARD_EAGER") == "1")
    res: dict = {"bench_policy": policy, "paths": capability_record(), "time_to_ready_s": ready, "precompile": getattr(core.runner, "precompile_summary", None), "weights_gib": core.info.weights_bytes / 2**30,
                 "kv_cache_gib": core.info.kv_cache_bytes / 2**30, "kv_tokens": core.info.kv_capacity_tokens}
    g = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    try:
        res.update(check_logits(core))
    except Exception as e:
        res["logits_check_error"] = repr(e)
    _run(core, [prompt(64)], 8)  # warm-up (JIT compile of the prefill shapes)
    for bs in (1, 16):
        # DECODE_REPEATS runs, the median reported (METHOD.md); min/max show the host's run-to-run spread
        tpots = []
        for _ in range(DECODE_REPEATS):
            times = _run(core, [prompt(512) for _ in range(bs)], 256)
            first = max(t[0] for t in times.values())
            last = max(t[-1] for t in times.values())
            tpots.append((last - first) / 255)
        tpot = sorted(tpots)[len(tpots) // 2]
        res[f"decode_bs{bs}_tok_s"] = bs / tpot
        res[f"decode_bs{bs}_tpot_ms"] = tpot * 1e3
        res[f"decode_bs{bs}_tok_s_min"] = bs / max(tpots)
        res[f"decode_bs{bs}_tok_s_max"] = bs / min(tpots)
    try:
        from bench.step_breakdown import breakdown
        for bs in (1, 16):
            res.update(breakdown(core, bs, V))
    except Exception as e:
        res["breakdown_error"] = repr(e)
    _run(core, [prompt(4096)], 1)
    pre = []
    for _ in range(3):
        t = _run(core, [prompt(4096)], 1)
        pre.append(4096 / next(iter(t.values()))[0])
    res["prefill_4096_tok_s"] = sorted(pre)[1]
    ttft = sorted(next(iter(_run(core, [prompt(2048)], 1).values()))[0] for _ in range(3))
    res["ttft_2048_ms"] = ttft[1] * 1e3
    res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["wall_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:28s} {v:10.2f}" if isinstance(v, (int, float)) else f"{k:28s} {v}")
    return res


def capability_record() -> dict:
    """The capability every kernel-path decision used (ONECARD_EMULATE_CC) and the card's own."""
    from onecard.kernels import paths

    return {"capability": paths.capability(), "real_capability": paths.real_capability(),
            "emulated": paths.emulated_capability()}


def logits_only(model_dir: str, out: str) -> dict:
    """The full-size logits check alone (tests/gpu runs it under ONECARD_EMULATE_CC=70)."""
    core, ready = _engine(model_dir, max_model_len=1024, gpu_memory_utilization=0.5)
    # 16 tokens: the kernels' prefill tiles; 80: below sm80 the chunk takes SDPA's attention (paths.prefill_sdpa)
    res = {"paths": capability_record(), "time_to_ready_s": ready, **check_logits(core),
           **{f"{k}_80": v for k, v in check_logits(core, 80).items()}}
    Path(out).write_text(json.dumps(res, indent=1))
    return res


@torch.inference_mode()
def check_logits(core, n: int = 16) -> dict:
    """Triton path vs reference path on the full-size model: logits of one n-token prefill."""
    from onecard.kernels import dispatch
    from onecard.kernels.attention.metadata import AttentionMetadata

    runner = core.runner
    model, dev, bs = runner.model, runner.device, runner.block_size
    ids = torch.randint(0, V, (n,), device=dev)
    blocks = (n + bs - 1) // bs
    md = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev) + bs, query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_table=torch.arange(1, blocks + 1, dtype=torch.int32, device=dev)[None], max_query_len=n, max_seq_len=n,
        host_query_start_loc=np.array([0, n], dtype=np.int32), host_seq_lens=np.array([n], dtype=np.int32))
    out = {}
    for backend in ("ref", "triton"):
        with dispatch.use_backend(backend):
            out[backend] = model.compute_logits(model(ids, torch.arange(n, device=dev), runner.kv_caches, md))
    a, b = out["ref"].float(), out["triton"].float()
    rel = ((a - b).norm() / a.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"full-size logits triton vs ref ({n} tokens): rel err {rel:.2e}, argmax agreement {agree:.3f}", flush=True)
    return {"logits_rel_err_triton_vs_ref": rel, "argmax_agreement": agree}


@torch.inference_mode()
def bench_hf(out: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    cfg = AutoConfig.for_model("qwen3_moe", **{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")})
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 experts_implementation="grouped_mm")
    model.eval()
    res: dict = {"build_s": time.perf_counter() - t0,
                 "weights_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30}

    def decode(bs: int, prompt_len: int, steps: int) -> float:
        ids = torch.randint(0, V, (bs, prompt_len), device="cuda")
        cache = DynamicCache(config=cfg)
        o = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = o.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            o = model(input_ids=nxt, past_key_values=o.past_key_values, use_cache=True)
            nxt = o.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        return bs * steps / (time.perf_counter() - t)

    decode(1, 32, 4)
    res["decode_bs1_tok_s"] = decode(1, 512, 32)
    res["decode_bs16_tok_s"] = decode(16, 512, 32)
    ids = torch.randint(0, V, (1, 4096), device="cuda")
    model(input_ids=ids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model(input_ids=ids)
    torch.cuda.synchronize()
    res["prefill_4096_tok_s"] = 4096 / (time.perf_counter() - t)
    Path(out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"hf {k:26s} {v:10.2f}")
    return res


KV_BYTES_PER_TOKEN = 2 * L * NKV * D * 2            # fp16 K and V of every layer: 98,304 B at 48 layers


def gptq_bytes(k: int, n: int) -> float:
    """Bytes of one W4 g128 GPTQ weight [K, N] as a kernel reads it: nibbles, fp16 scales, packed zeros."""
    from onecard.core.spec.cost import gptq_weight_bytes

    return gptq_weight_bytes(k, n, 4, G)


def step_weight_bytes(bs: int) -> float:
    """Weight bytes one decode step of ``bs`` sequences reads (uniform routing: the expected number of distinct
    experts per layer): attention GEMMs, router, lm_head (fp16) and the distinct experts' GEMMs."""
    attn = L * (gptq_bytes(H, (NQ + 2 * NKV) * D) + gptq_bytes(NQ * D, H))
    expert = 2 * gptq_bytes(H, I) + gptq_bytes(I, H)
    from onecard.core.spec.cost import expected_distinct_experts

    distinct = expected_distinct_experts(bs, E, TOPK)
    return attn + L * E * H * 2 + V * H * 2 + L * distinct * expert


def step_bytes(bs: int, ctx: int) -> float:
    """The bandwidth floor's bytes for one decode step: weights plus every sequence's KV cache (ctx tokens)."""
    return step_weight_bytes(bs) + bs * ctx * KV_BYTES_PER_TOKEN


def copy_bandwidth() -> float:
    """Device copy bandwidth, bytes/s (read + write of 2 GiB, 10 copies)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        y.copy_(x)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (ev[0].elapsed_time(ev[1]) / 1e3)


def floor(out: str) -> dict:
    bw = copy_bandwidth()
    res = {"copy_bandwidth_tb_s": bw / 1e12}
    for bs in (1, 16):
        b = step_bytes(bs, 512)
        res[f"bytes_per_step_bs{bs}_gb"] = b / 1e9
        res[f"floor_bs{bs}_ms"] = b / bw * 1e3
        res[f"floor_bs{bs}_tok_s"] = bs / (b / bw)
    Path(out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"floor {k:24s} {v:10.3f}")
    return res


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "build":
        build(Path(sys.argv[2]))
    elif cmd == "onecard":
        bench_onecard(sys.argv[2], sys.argv[3])
    elif cmd == "hf":
        bench_hf(sys.argv[2])
    elif cmd == "floor":
        floor(sys.argv[2])
    elif cmd == "logits":
        logits_only(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
