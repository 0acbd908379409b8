"""Checkpoints whose safetensors HEADERS describe real shapes, written as sparse files (no tensor data).

``write_sparse_safetensors(file, {name: (dtype, shape)})`` writes the 8-byte header length, the JSON header
and then extends the file to its full size with ``truncate`` so the data region is a hole: a 61 GB BF16
checkpoint costs a few MB of disk. ``qwen3_coder_30b(dir, fmt)`` writes config.json (+ quantize_config.json
for GPTQ) and 4 shards with an index for Qwen3-Coder-30B-A3B-Instruct as "gptq" (4-bit, group 128, sym,
desc_act false, lm_head/embedding fp16, router gates fp16) or "bf16".
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "F8_E4M3": 1}

QWEN3_CODER_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000000, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "bos_token_id": 151643, "eos_token_id": 151645,
}


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (/proc/self/io rchar): a deterministic stand-in for
    "planning is fast". Reading a checkpoint's tensors moves gigabytes; its headers and config files kilobytes."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def write_sparse_safetensors(file: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Header + a hole of the right size; returns the data bytes described."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                     # safetensors pads the header to 8 bytes
    with file.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        fh.truncate(8 + len(raw) + off)
    return off


def _linear(prefix: str, k: int, n: int, fmt: str, group: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    if fmt == "gptq":
        g = math.ceil(k / group)
        return {f"{prefix}.qweight": ("I32", (k // 8, n)), f"{prefix}.qzeros": ("I32", (g, n // 8)),
                f"{prefix}.scales": ("F16", (g, n)), f"{prefix}.g_idx": ("I32", (k,))}
    return {f"{prefix}.weight": ("BF16", (n, k))}


def qwen3_coder_tensors(cfg: dict, fmt: str, group: int = 128) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
    """Per-layer tensor dicts (embedding with the first layer, norm + lm_head with the last)."""
    h, d, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    hq, hkv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["moe_intermediate_size"]
    flt = "F16" if fmt == "gptq" else "BF16"
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t: dict[str, tuple[str, tuple[int, ...]]] = {}
        if i == 0:
            t["model.embed_tokens.weight"] = (flt, (v, h))
        t[f"{p}.input_layernorm.weight"] = (flt, (h,))
        t[f"{p}.post_attention_layernorm.weight"] = (flt, (h,))
        for name, k, n in (("q_proj", h, hq), ("k_proj", h, hkv), ("v_proj", h, hkv), ("o_proj", hq, h)):
            t.update(_linear(f"{p}.self_attn.{name}", k, n, fmt, group))
        t[f"{p}.self_attn.q_norm.weight"] = (flt, (d,))
        t[f"{p}.self_attn.k_norm.weight"] = (flt, (d,))
        t[f"{p}.mlp.gate.weight"] = (flt, (cfg["num_experts"], h))
        for e in range(cfg["num_experts"]):
            q = f"{p}.mlp.experts.{e}"
            t.update(_linear(f"{q}.gate_proj", h, inter, fmt, group))
            t.update(_linear(f"{q}.up_proj", h, inter, fmt, group))
            t.update(_linear(f"{q}.down_proj", inter, h, fmt, group))
        if i == cfg["num_hidden_layers"] - 1:
            t["model.norm.weight"] = (flt, (h,))
            t["lm_head.weight"] = (flt, (v, h))
        layers.append(t)
    return layers


def write_checkpoint(root: Path, cfg: dict, layers: list[dict], shards: int = 4,
                     quantize_config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    if quantize_config is not None:
        (root / "quantize_config.json").write_text(json.dumps(quantize_config))
    per = math.ceil(len(layers) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for layer in layers[s * per:(s + 1) * per]:
            tensors.update(layer)
        total += write_sparse_safetensors(root / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return root


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
               "lm_head": False, "checkpoint_format": "gptq", "pack_dtype": "int32"}


def qwen3_coder_30b(root: Path, fmt: str = "gptq", **overrides) -> Path:
    """Qwen3-Coder-30B-A3B-Instruct metadata as "gptq" (W4 g128) or "bf16"; ``overrides`` edit config.json."""
    cfg = {**QWEN3_CODER_30B, **overrides}
    return write_checkpoint(root, cfg, qwen3_coder_tensors(cfg, fmt),
                            quantize_config=GPTQ_CONFIG if fmt == "gptq" else None)
