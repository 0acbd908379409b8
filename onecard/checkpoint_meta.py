"""Checkpoint metadata without tensor data: config.json, the quantization config and safetensors HEADERS.

Contract: ``read_checkpoint_meta(path) -> CheckpointMeta`` reads ``config.json``, the GPTQ config
(``onecard.config.read_quant_config``) and, for every shard (``model.safetensors.index.json`` or
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

from onecard.config import ConfigError, QuantConfig, read_json, read_quant_config, read_raw_quant_config

# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
_MAX_HEADER = 100 << 20        # safetensors itself refuses headers above 100 MB


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
    meta = CheckpointMeta(path=path, hf_config=cfg, quant=quant, quant_method=method)
    if with_tensors:
        meta.files = shard_names(path)
        for f in meta.files:
            meta.tensors.update(read_safetensors_header(path / f))
    return meta
