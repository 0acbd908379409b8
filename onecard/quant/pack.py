"""GPTQ (round-to-nearest) copies of float HF checkpoints, GPTQModel's ``dynamic`` rules, safetensors dirs.

Contract: ``gptq_copy`` writes a GPTQ checkpoint from a float HF one (quantizing attention/MLP/expert
projections with ``quantizer.quantize_rtn``; router, norms, embeddings and lm_head stay float), honouring
``dynamic`` overrides ("-:" = leave the module unquantized); the tensors are in the format of
``onecard.kernels.gptq_gemm.format``. ``dynamic_override`` is the one implementation of GPTQModel's ``dynamic``
matching. ``read_safetensors_dir`` / ``save_safetensors`` read and write a model
directory's tensors (single file or index + shards).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from onecard.kernels.gptq_gemm.format import BITS
from onecard.quant.quantizer import QuantizedLinear, quantize_rtn

# Module suffixes that GPTQModel quantizes in Qwen3 / Qwen3-MoE (the router `mlp.gate` is NOT among them).
QUANTIZED_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


# ---------------------------------------------------------------- dynamic overrides
def dynamic_override(dynamic: dict[str, dict[str, Any]] | None, module: str) -> dict[str, Any] | None:
    """GPTQModel's ``dynamic``: the first rule whose regex matches ``module`` (re.match on the module name).

    Returns None for "leave unquantized" (a "-:" rule), else the override dict ({} when nothing matched).
    """
    for pattern, overrides in (dynamic or {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], module):
                return None
        elif re.match(pattern.removeprefix("+:"), module):
            return dict(overrides or {})
    return {}


def is_quantizable(module: str) -> bool:
    return module.endswith(QUANTIZED_SUFFIXES) or bool(_EXPERT_RE.search(module))


# ---------------------------------------------------------------- checkpoint copy
def _iter_float_tensors(src: Path):
    """Yield (name, tensor) one shard at a time (single file or index)."""
    from safetensors import safe_open

    index = src / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    for fname in files:
        with safe_open(str(src / fname), "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_safetensors_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model directory (model.safetensors or the shards named by the index)."""
    return dict(_iter_float_tensors(Path(model_dir)))


def save_safetensors(tensors: dict[str, torch.Tensor], dst: str | Path, num_shards: int = 1) -> None:
    """model.safetensors, or ``num_shards`` files model-0000i-of-0000n.safetensors plus the index json."""
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards <= 1:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc, i = 0, 0
    for key in sorted(tensors):                                            # balanced by bytes, in key order
        if acc >= total / num_shards * (i + 1) and i < num_shards - 1:
            i += 1
        shards[i].append(key)
        acc += tensors[key].numel() * tensors[key].element_size()
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _split_one(name: str, t: torch.Tensor):
    """transformers-5 fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> per-expert Linears."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("experts.gate_up_proj"):
        half = t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]
            yield f"{prefix}.{e}.up_proj.weight", t[e, half:]
    elif name.endswith("experts.down_proj"):
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", t[e]
    else:
        yield name, t


def split_fused_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with transformers-5 fused expert tensors -> the per-expert layout real checkpoints use
    (``mlp.experts.E.{gate,up,down}_proj.weight`` [out, in]); other tensors pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        for n, v in _split_one(name, t):
            out[n] = v.contiguous()
    return out


def gptq_copy(src_dir: str | Path, dst_dir: str | Path, group_size: int = 32, sym: bool = True,
              fmt: str = "gptq", desc_act: bool = False, dynamic: dict[str, dict[str, Any]] | None = None,
              seed: int = 0, float_dtype: torch.dtype = torch.float16, num_shards: int = 1,
              record: dict[str, QuantizedLinear] | None = None) -> Path:
    """Write a GPTQ (RTN) copy of the float HF checkpoint ``src_dir`` into ``dst_dir``.

    desc_act=True draws a random activation order per module (seeded) so g_idx is shuffled. Float tensors
    (router, norms, embeddings, lm_head) are written in ``float_dtype``; scales in fp16 like GPTQModel.
    ``num_shards`` > 1 writes an index + shards; ``record`` (if given) receives module -> QuantizedLinear.
    """

    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for raw_name, raw in _iter_float_tensors(src):
        for name, t in _split_one(raw_name, raw):
            module = name.removesuffix(".weight")
            over = dynamic_override(dynamic, module) if is_quantizable(module) and name.endswith(".weight") \
                else None
            if over is None:
                out[name] = t.to(float_dtype).contiguous()
                continue
            bits = int(over.get("bits", BITS))
            if bits != BITS:
                raise ValueError(f"dynamic rule for {module} asks bits={bits}; the packer writes 4-bit only.")
            g = int(over.get("group_size", group_size))
            s = bool(over.get("sym", sym))
            da = bool(over.get("desc_act", desc_act))
            perm = torch.randperm(t.shape[1], generator=gen) if da else None
            ql = quantize_rtn(t, g, s, perm, min_zero=1 if fmt == "gptq" else 0)
            out.update({f"{module}.{part}": v for part, v in ql.disk_tensors(fmt).items()})
            if record is not None:
                record[module] = ql
    save_safetensors(out, dst, num_shards)

    qcfg: dict[str, Any] = {"bits": BITS, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                            "lm_head": False, "quant_method": "gptq", "checkpoint_format": fmt,
                            "pack_dtype": "int32", "damp_percent": 0.01, "true_sequential": True,
                            "meta": {"quantizer": ["onecard:rtn"]}}
    if dynamic:
        qcfg["dynamic"] = dynamic
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    cfg["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    for p in src.iterdir():
        if p.is_file() and p.name not in ("config.json", "model.safetensors", "model.safetensors.index.json") \
                and not p.name.endswith(".safetensors"):
            shutil.copy(p, dst / p.name)
    return dst
