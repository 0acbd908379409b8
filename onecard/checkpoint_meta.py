"""Checkpoint metadata without tensor data: config.json, generation_config.json, the quantization config and
safetensors HEADERS.

Contract: ``read_checkpoint_meta(path) -> CheckpointMeta`` reads ``config.json``, ``generation_config.json``
(when present), the GPTQ config (``read_quant_config``: ``QuantConfig``, or ``ConfigError`` naming what is not
supported) and, for every shard (``model.safetensors.index.json`` or
``*.safetensors``), only the 8-byte little-endian header length and the JSON header that follows it: name,
dtype, shape and byte range of every tensor. Tensor bytes are never read, so a 60 GB checkpoint is scanned in
well under a second. A shard shorter than its header says (an interrupted download) or a header that is not
valid safetensors raises ``ConfigError`` naming the file.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onecard.env import ConfigError

# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
_MAX_HEADER = 100 << 20        # safetensors itself refuses headers above 100 MB


@dataclass(slots=True)
class QuantConfig:
    """GPTQ settings read from quantize_config.json or config.json's quantization_config."""

    method: str                    # "gptq"
    bits: int
    group_size: int                # -1 = whole column
    desc_act: bool
    sym: bool
    checkpoint_format: str         # "gptq" (v1, zeros stored minus one) | "gptq_v2"
    lm_head: bool
    dynamic: dict[str, dict[str, Any]] = field(default_factory=dict)  # regex -> overrides; "-:" = skip


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: not a Hugging Face model directory.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def read_raw_quant_config(path: Path, hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config, else quantize_config.json, unvalidated; None if neither."""
    raw = hf_config.get("quantization_config")
    qfile = path / "quantize_config.json"
    if raw is None and qfile.exists():
        raw = read_json(qfile)
    return raw


def read_quant_config(path: Path, hf_config: dict[str, Any]) -> QuantConfig | None:
    """GPTQ settings from config.json's quantization_config, else quantize_config.json; None if neither."""
    raw = read_raw_quant_config(path, hf_config)
    if raw is None:
        return None
    method = str(raw.get("quant_method", "gptq")).lower()
    if method not in ("gptq",):
        raise ConfigError(f"quantization method {method!r} in {path} is not supported; onecard runs gptq.")
    bits = int(raw.get("bits", 4))
    if bits != 4:
        raise ConfigError(f"GPTQ bits={bits} in {path} is not supported; onecard runs 4-bit GPTQ only.")
    fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"GPTQ checkpoint_format={fmt!r} is not supported; use gptq (v1) or gptq_v2.")
    return QuantConfig(
        method="gptq", bits=bits, group_size=int(raw.get("group_size", 128)),
        desc_act=bool(raw.get("desc_act", False)), sym=bool(raw.get("sym", True)), checkpoint_format=fmt,
        lm_head=bool(raw.get("lm_head", False)), dynamic=dict(raw.get("dynamic") or {}))


@dataclass(slots=True)
class TensorMeta:
    name: str
    dtype: str                 # safetensors dtype: "F16", "BF16", "I32", ...
    shape: tuple[int, ...]
    file: str                  # shard file name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(slots=True)
class CheckpointMeta:
    path: Path
    hf_config: dict[str, Any]
    quant: QuantConfig | None
    quant_method: str | None = None      # as written in the checkpoint ("gptq", "fp8", ...), None = float
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    generation_config: dict[str, Any] = field(default_factory=dict)   # generation_config.json ({} if none)

    @property
    def architecture(self) -> str | None:
        archs = self.hf_config.get("architectures") or []
        return str(archs[0]) if archs else None

    @property
    def stored_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def stored_bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out


def read_safetensors_header(file: Path) -> dict[str, TensorMeta]:
    """Tensor metadata of one safetensors file: reads 8 + header-length bytes, nothing else."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ConfigError(f"{file} is not a safetensors file (shorter than 8 bytes).")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ConfigError(f"{file} is not a valid safetensors file (header length {n}, file {size} B).")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise ConfigError(f"checkpoint shard {file} is missing.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: the safetensors header is not valid JSON ({e}).") from None
    out: dict[str, TensorMeta] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = str(info["dtype"]), tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{file}: tensor {name!r} has a malformed header entry {info!r}.") from None
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"{file}: tensor {name!r} has unknown dtype {dtype!r}.")
        t = TensorMeta(name=name, dtype=dtype, shape=shape, file=file.name)
        if int(end) - int(begin) != t.nbytes:
            raise ConfigError(f"{file}: tensor {name!r} {dtype}{list(shape)} spans {int(end) - int(begin)} B, "
                              f"expected {t.nbytes} B.")
        data_end = max(data_end, int(end))
        out[name] = t
    if 8 + n + data_end > size:
        raise ConfigError(f"{file} is truncated: its header describes {8 + n + data_end} B but the file has "
                          f"{size} B (an interrupted download?). Download the checkpoint again.")
    return out


def shard_names(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from None
        return list(dict.fromkeys(weight_map.values()))
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}; onecard loads safetensors checkpoints only.")
    return files


def read_config(path: Path) -> dict[str, Any]:
    return read_json(path / "config.json")


def quant_method_of(path: Path, hf_config: dict[str, Any]) -> str | None:
    raw = read_raw_quant_config(path, hf_config)
    return None if raw is None else str(raw.get("quant_method", "gptq")).lower()


def read_checkpoint_meta(path: Path, hf_config: dict[str, Any] | None = None,
                         with_tensors: bool = True) -> CheckpointMeta:
    """config + quant config + (optionally) every shard's tensor headers; no tensor data."""
    path = Path(path)
    cfg = read_config(path) if hf_config is None else hf_config
    method = quant_method_of(path, cfg)
    # A non-GPTQ method (fp8, awq, ...) is reported, not raised, so the planner can say why it is refused.
    quant = read_quant_config(path, cfg) if method in (None, "gptq") else None
    gen = path / "generation_config.json"
    meta = CheckpointMeta(path=path, hf_config=cfg, quant=quant, quant_method=method,
                          generation_config=read_json(gen) if gen.exists() else {})
    if with_tensors:
        meta.files = shard_names(path)
        for f in meta.files:
            meta.tensors.update(read_safetensors_header(path / f))
    return meta
