"""Reading float HF checkpoints and writing/reading GPTQ checkpoints (GPTQModel/AutoGPTQ layout).

Contract:
  ``FloatCheckpoint(model_dir)``: lazy access to a safetensors checkpoint (single file or index shards):
  ``.config`` (dict), ``.keys()``, ``.get(name, device)`` (float32).
  ``quantize_config_dict(spec, checkpoint_format, damp, method)`` is the quantize_config.json content, also
  written as ``quantization_config`` in config.json.
  ``write_gptq_checkpoint(src, out_dir, tensors, spec, ...)`` writes model.safetensors (packed linears +
  fp16 everything else), config.json, quantize_config.json, and copies tokenizer/generation files.
  ``load_gptq_as_float(model_dir) -> (config, state_dict)`` dequantizes a GPTQ checkpoint (v1 or v2, any
  g_idx; ``gptq_gemm.format.dequantize``) to float32 nn.Linear weights [out, in] — for evaluation with HF
  classes and for tests.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from onecard.kernels.gptq_gemm.format import dequantize
from onecard.quant.pack import read_safetensors_dir
from onecard.quant.quantizer import QuantSpec

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "quantize_config.json")


class FloatCheckpoint:
    def __init__(self, model_dir: Path) -> None:
        self.dir = Path(model_dir)
        cfg_path = self.dir / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{self.dir} has no config.json; pass a Hugging Face model directory.")
        self.config: dict = json.loads(cfg_path.read_text())
        if self.config.get("quantization_config"):
            raise ValueError(f"{self.dir} is already quantized ({self.config['quantization_config'].get('quant_method')}); "
                             "pass the float checkpoint.")
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            wmap = json.loads(index.read_text())["weight_map"]
            self._where = {k: self.dir / f for k, f in wmap.items()}
        elif (self.dir / "model.safetensors").exists():
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                self._where = {k: self.dir / "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir} has no model.safetensors (or index); only safetensors is read.")
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        path = self._where[name]
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = safe_open(path, "pt")
        return h.get_tensor(name).to(device=device, dtype=torch.float32)


def quantize_config_dict(spec: QuantSpec, checkpoint_format: str = "gptq", damp: float = 0.01,
                         method: str = "gptq") -> dict:
    return {
        "bits": spec.bits,
        "group_size": spec.group_size,
        "desc_act": spec.desc_act,
        "sym": spec.sym,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "damp_percent": damp,
        "static_groups": False,
        "true_sequential": True,
        "meta": {"quantizer": ["onecard"], "method": method},
    }


def write_gptq_checkpoint(src: FloatCheckpoint, out_dir: Path, packed: dict[str, dict[str, torch.Tensor]],
                          spec: QuantSpec, checkpoint_format: str = "gptq", damp: float = 0.01,
                          method: str = "gptq") -> None:
    """packed: linear name (e.g. model.layers.0.self_attn.q_proj) -> its four packed tensors."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in src.keys():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in packed:
            continue
        tensors[name] = src.get(name).to(torch.float16).contiguous()
    for base, parts in packed.items():
        for part, t in parts.items():
            tensors[f"{base}.{part}"] = t.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    qcfg = quantize_config_dict(spec, checkpoint_format, damp, method)
    cfg = dict(src.config)
    cfg["quantization_config"] = qcfg
    cfg["torch_dtype"] = "float16"        # vLLM runs GPTQ in fp16
    cfg["dtype"] = "float16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
    for f in sorted(src.dir.iterdir()):
        if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, out_dir / f.name)


def load_gptq_as_float(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    qcfg = cfg.get("quantization_config") or json.loads((model_dir / "quantize_config.json").read_text())
    fmt = qcfg.get("checkpoint_format", "gptq")
    group = int(qcfg.get("group_size", 128))
    raw = read_safetensors_dir(model_dir)
    out: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        if k.endswith(".qweight"):
            base = k.removesuffix(".qweight")
            w = dequantize(t, raw[base + ".qzeros"], raw[base + ".scales"], raw.get(base + ".g_idx"), fmt, group)
            out[base + ".weight"] = w.t().contiguous()                                    # [N, K]
        elif not k.endswith((".qzeros", ".scales", ".g_idx")):
            out[k] = t.float()
    return cfg, out


def dequantize_checkpoint(gptq_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a plain float HF checkpoint (per-expert keys, no quantization_config) of a GPTQ one, so that
    ``from_pretrained`` of any transformers version can run it (its fused-expert conversion included)."""
    cfg, state = load_gptq_as_float(gptq_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in sorted(Path(gptq_dir).iterdir()):
        if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, out_dir / f.name)
    return out_dir
