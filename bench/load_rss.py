"""Peak host RSS while loading a ~1 GB synthetic GPTQ Qwen3-MoE checkpoint written in several shards.

Usage: ``python bench/load_rss.py [--gib 1.0] [--shard-mib 256] [--device cpu|cuda] [--keep DIR]``.
It writes the checkpoint (random packed int4 experts and attention, fp16 embeddings/lm_head/router/norms;
layer tensors straddle shard boundaries as in real checkpoints) into a temporary directory, then loads it
with ``onecard.models.loader.load_model`` in a fresh subprocess and prints one JSON line:
checkpoint bytes, largest shard, RSS after imports, peak RSS (ru_maxrss), bytes placed on the device, and
the host overhead = peak - baseline - (placed bytes when the device is the CPU), split by a 2 ms sampler
into anonymous memory (tensor copies not yet placed) and file-backed pages (the mmapped shard being read). The loader's promise is an
overhead of about one shard (plus one layer's pending expert tensors).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# Qwen3-MoE-like shape scaled down so that a few layers weigh ~1 GB.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 16, 4, 128
EXPERTS, TOP_K, MOE_INTER, VOCAB, GROUP = 64, 8, 768, 32000, 128


def _layer_bytes() -> int:
    def lin(k: int, n: int) -> int:
        return k * n // 2 + (k // GROUP) * n * 2 + (k // GROUP) * n // 2 + k * 4
    attn = lin(HIDDEN, HEADS * HEAD_DIM) + 2 * lin(HIDDEN, KV_HEADS * HEAD_DIM) + lin(HEADS * HEAD_DIM, HIDDEN)
    return attn + EXPERTS * (2 * lin(HIDDEN, MOE_INTER) + lin(MOE_INTER, HIDDEN))


def _gptq(prefix: str, k: int, n: int, gen) -> dict:
    import torch

    g = k // GROUP
    return {f"{prefix}.qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen),
            f"{prefix}.qzeros": torch.full((g, n // 8), 0x77777777, dtype=torch.int32),   # sym v1
            f"{prefix}.scales": (torch.rand(g, n, generator=gen) * 1e-2).half(),
            f"{prefix}.g_idx": (torch.arange(k) // GROUP).to(torch.int32)}


def _layer(i: int, gen) -> dict:
    import torch

    p = f"model.layers.{i}"
    t: dict = {f"{p}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.float16),
               f"{p}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.float16),
               f"{p}.self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=torch.float16),
               f"{p}.self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=torch.float16),
               f"{p}.mlp.gate.weight": torch.randn(EXPERTS, HIDDEN, generator=gen).half()}
    t.update(_gptq(f"{p}.self_attn.q_proj", HIDDEN, HEADS * HEAD_DIM, gen))
    t.update(_gptq(f"{p}.self_attn.k_proj", HIDDEN, KV_HEADS * HEAD_DIM, gen))
    t.update(_gptq(f"{p}.self_attn.v_proj", HIDDEN, KV_HEADS * HEAD_DIM, gen))
    t.update(_gptq(f"{p}.self_attn.o_proj", HEADS * HEAD_DIM, HIDDEN, gen))
    for e in range(EXPERTS):
        q = f"{p}.mlp.experts.{e}"
        t.update(_gptq(f"{q}.gate_proj", HIDDEN, MOE_INTER, gen))
        t.update(_gptq(f"{q}.up_proj", HIDDEN, MOE_INTER, gen))
        t.update(_gptq(f"{q}.down_proj", MOE_INTER, HIDDEN, gen))
    return t


def build(path: Path, gib: float, shard_mib: int) -> Path:
    """Write the synthetic checkpoint; tensors are generated and flushed one shard at a time."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    fixed = 2 * VOCAB * HIDDEN * 2
    layers = max(1, round((gib * 2**30 - fixed) / _layer_bytes()))
    qcfg = {"bits": 4, "group_size": GROUP, "desc_act": False, "sym": True, "lm_head": False,
            "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32"}
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
           "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "intermediate_size": 4 * HIDDEN, "moe_intermediate_size": MOE_INTER,
           "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "torch_dtype": "float16", "quantization_config": qcfg}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    gen = torch.Generator().manual_seed(0)
    limit = shard_mib << 20
    shard: dict = {}
    shards: list[dict] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shards.append({})
            shard.clear()

    def add(tensors: dict) -> None:
        for k, v in tensors.items():
            shard[k] = v
            if sum(x.numel() * x.element_size() for x in shard.values()) >= limit:
                flush()

    add({"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).half()})
    for i in range(layers):
        add(_layer(i, gen))
    add({"model.norm.weight": torch.ones(HIDDEN, dtype=torch.float16),
         "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).half()})
    flush()
    # Rename to the "-of-N" spelling HF uses, then write the index.
    n = len(shards)
    rename = {f"model-{i + 1:05d}.safetensors": f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)}
    for old, new in rename.items():
        (path / old).rename(path / new)
    weight_map = {k: rename[v] for k, v in weight_map.items()}
    total = sum((path / f).stat().st_size for f in rename.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return path


def _status(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rss_bytes() -> int:
    return _status("VmRSS")


class _Sampler:
    """Peak anonymous (heap copies) and file-backed (mmapped shard pages) RSS, sampled every 2 ms."""

    def __init__(self) -> None:
        import threading

        self.peak_anon = self.peak_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, _status("RssAnon"))
            self.peak_file = max(self.peak_file, _status("RssFile"))
            self._stop.wait(0.002)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def load_child(path: Path, device: str) -> dict:
    import torch

    from onecard.config import EngineArgs
    from onecard.models.loader import load_model

    cfg = EngineArgs(model=str(path), device=device, dtype="float16").create_config()
    baseline, base_anon, base_file = _rss_bytes(), _status("RssAnon"), _status("RssFile")
    t0 = time.perf_counter()
    with _Sampler() as sampler:
        model = load_model(cfg.model, torch.device(device), torch.float16)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    placed_on_host = model.weights_bytes if device == "cpu" else 0
    return {"baseline_rss": baseline, "peak_rss": peak, "weights_bytes": model.weights_bytes,
            "host_overhead": peak - baseline - placed_on_host,
            "anon_overhead": sampler.peak_anon - base_anon - placed_on_host,
            "file_pages_peak": sampler.peak_file - base_file, "load_seconds": round(seconds, 2)}


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cuda (default if present), cpu, meta")
    ap.add_argument("--keep", type=Path, help="build (or reuse) the checkpoint here instead of a temp dir")
    ap.add_argument("--load", type=Path, help=argparse.SUPPRESS)      # internal: the measuring child
    args = ap.parse_args()
    if args.load:
        print(json.dumps(load_child(args.load, args.device)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "ckpt"
        if not (path / "model.safetensors.index.json").exists():
            build(path, args.gib, args.shard_mib)
        files = sorted(path.glob("*.safetensors"))
        child = subprocess.run([sys.executable, __file__, "--load", str(path), "--device", args.device],
                               check=True, capture_output=True, text=True)
        res = json.loads(child.stdout.strip().splitlines()[-1])
        res.update({"checkpoint_bytes": sum(f.stat().st_size for f in files), "shards": len(files),
                    "largest_shard": max(f.stat().st_size for f in files), "device": args.device})
        gib = {k: round(v / 2**30, 3) for k, v in res.items() if isinstance(v, int) and k != "shards"}
        print(json.dumps({**res, "gib": gib}))


if __name__ == "__main__":
    main()
