"""Helpers for model tests: load our model / HF's model from a directory, HF reference logits, and an
independent GPTQ-to-float converter (written here from the on-disk spec, not shared with the loader)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RTOL, ATOL = 1e-4, 2e-5


def load_ours(model_dir: Path, **engine_kwargs):
    from onecard.config import EngineArgs
    from onecard.models.loader import load_model

    cfg = EngineArgs(model=str(model_dir), device="cpu", **engine_kwargs).create_config().model
    return load_model(cfg, torch.device("cpu"), torch.float32)


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.float().eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of the HF model over one unpadded sequence."""
    return model(torch.tensor([ids])).logits[0].float()


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------ independent GPTQ -> float
def unpack_nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 packed along ``dim`` (8 nibbles per word, nibble j at bits 4j..4j+3) -> int64 codes 0..15."""
    u = x.to(torch.int64) & 0xFFFFFFFF                                   # the unsigned bit pattern
    parts = [(u >> (4 * j)) & 0xF for j in range(8)]
    stacked = torch.stack(parts, dim=dim + 1)                             # [..., R, 8, ...]
    shape = list(x.shape)
    shape[dim] *= 8
    return stacked.reshape(shape)


def dequantize_module(qweight, qzeros, scales, g_idx, v1: bool) -> torch.Tensor:
    """The float nn.Linear weight [N, K] of one GPTQ module."""
    q = unpack_nibbles(qweight, 0)                                        # [K, N]
    z = unpack_nibbles(qzeros, 1)                                         # [G, N]
    if v1:
        z = (z + 1) % 16
    g = g_idx.to(torch.int64)
    w = (q - z[g]).to(torch.float64) * scales.to(torch.float64)[g]        # [K, N]
    return w.t().to(torch.float32).contiguous()


def gptq_to_float_dir(src: Path, dst: Path) -> Path:
    """A float32 checkpoint with the dequantized weights of the GPTQ checkpoint ``src`` (single file)."""
    cfg = json.loads((src / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    v1 = qcfg.get("checkpoint_format", "gptq") == "gptq"
    files = ([src / "model.safetensors"] if (src / "model.safetensors").exists() else
             [src / f for f in sorted(set(json.loads((src / "model.safetensors.index.json").read_text())
                                          ["weight_map"].values()))])
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            raw.update({k: h.get_tensor(k) for k in h.keys()})
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".qweight"):
            m = name[: -len(".qweight")]
            k = t.shape[0] * 8
            gi = raw.get(f"{m}.g_idx")
            if gi is None:
                gs = -(-k // raw[f"{m}.scales"].shape[0])
                gi = torch.arange(k) // gs
            out[f"{m}.weight"] = dequantize_module(t, raw[f"{m}.qzeros"], raw[f"{m}.scales"], gi, v1)
        elif name.rsplit(".", 1)[-1] in ("qzeros", "scales", "g_idx"):
            continue
        else:
            out[name] = t.to(torch.float32)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "quantize_config.json", "model.safetensors.index.json") \
                and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst
