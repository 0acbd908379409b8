"""Round-to-nearest GPTQ packer: float weights -> the exact on-disk GPTQ 4-bit tensors, and back.

Contract (GPTQModel/AutoGPTQ layout, REFERENCE.md "GPTQ on disk"): for an nn.Linear weight w [N, K]
(y = x @ w.T, K = in, N = out, G = ceil(K / group) groups):
  qweight int32 [K/8, N]  nibble j (shift 4j) of row r holds q[8r + j, n]
  qzeros  int32 [G, N/8]  nibble j of column c holds the stored zero of output 8c + j
                          ("gptq" = v1 stores true zero - 1; "gptq_v2" stores the true zero)
  scales  fp16  [G, N]
  g_idx   int32 [K]       group of input row k: k // group, or (desc_act) the group of k's rank in the
                          activation order ``desc_act_perm`` (a shuffled, non-monotonic g_idx)
  W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
``quantize_rtn`` returns a ``QuantizedLinear`` (packed tensors with TRUE zeros, codes, exact dequantization);
``.disk_tensors(fmt)`` applies the v1 zero convention (``to_v1``/``from_v1``); ``dequantize`` reads disk tensors. ``gptq_copy`` writes a
GPTQ checkpoint from a float HF one (quantizing attention/MLP/expert projections; router, norms, embeddings
and lm_head stay float), honouring ``dynamic`` overrides ("-:" = leave the module unquantized).
``dynamic_override`` is the one implementation of GPTQModel's ``dynamic`` matching (the loader uses it too).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from dataclasses import dataclass

import torch

BITS = 4
MAXQ = (1 << BITS) - 1
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)                     # [8] nibble j at bit 4j

# Module suffixes that GPTQModel quantizes in Qwen3 / Qwen3-MoE (the router `mlp.gate` is NOT among them).
QUANTIZED_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


# ---------------------------------------------------------------- bit packing
def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32 (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] codes in [0, 15] -> int32 [R/8, C]; row 8r + j goes to nibble j of packed row r."""
    r, c = q.shape
    if r % 8:
        raise ValueError(f"packing needs a size divisible by 8, got {r}")
    v = q.to(torch.int64).reshape(r // 8, 8, c)                             # [R/8, 8, C]
    return _to_int32((v << _SHIFTS.view(1, 8, 1)).sum(dim=1))


def pack_cols(z: torch.Tensor) -> torch.Tensor:
    """int [R, C] codes in [0, 15] -> int32 [R, C/8]; column 8c + j goes to nibble j of packed column c."""
    return pack_rows(z.t().contiguous()).t().contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [8R, C] codes."""
    v = packed.to(torch.int64).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)       # [R, 8, C]
    return (v & 0xF).reshape(-1, packed.shape[1]).to(torch.int32)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8C] codes."""
    return unpack_rows(packed.t().contiguous()).t().contiguous()


# ---------------------------------------------------------------- v1 zeros
def to_v1(qzeros: torch.Tensor) -> torch.Tensor:
    """Packed TRUE zeros -> v1 (every nibble minus one, mod 16)."""
    return pack_cols((unpack_cols(qzeros) - 1) % 16)


def from_v1(qzeros: torch.Tensor) -> torch.Tensor:
    """Packed v1 zeros -> TRUE zeros (every nibble plus one, mod 16)."""
    return pack_cols((unpack_cols(qzeros) + 1) % 16)


# ---------------------------------------------------------------- quantization
def num_groups(in_features: int, group_size: int) -> int:
    g = in_features if group_size in (-1, 0) else group_size
    return (in_features + g - 1) // g


def trivial_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    g = in_features if group_size in (-1, 0) else group_size
    return (torch.arange(in_features) // g).to(torch.int32)


@dataclass(slots=True)
class QuantizedLinear:
    """One RTN-quantized linear. ``qzeros`` holds TRUE zeros; ``disk_tensors(fmt)`` gives what is written."""

    qweight: torch.Tensor      # int32 [K/8, N]
    qzeros: torch.Tensor       # int32 [G, N/8] true zeros
    scales: torch.Tensor       # fp16 [G, N]
    g_idx: torch.Tensor        # int32 [K]
    group_size: int            # K when asked for -1
    q: torch.Tensor            # int32 [K, N] codes
    zeros: torch.Tensor        # int32 [G, N] true zeros
    dequant: torch.Tensor      # float32 [K, N] = (q - z[g]) * s[g], exactly what the packed tensors mean

    def disk_tensors(self, fmt: str = "gptq") -> dict[str, torch.Tensor]:
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint format {fmt!r}: use 'gptq' (v1) or 'gptq_v2'.")
        qz = to_v1(self.qzeros) if fmt == "gptq" else self.qzeros
        return {"qweight": self.qweight, "qzeros": qz, "scales": self.scales, "g_idx": self.g_idx}

    def __iter__(self):
        """``qweight, qzeros, scales, g_idx = quantize_rtn(...)`` (true zeros)."""
        return iter((self.qweight, self.qzeros, self.scales, self.g_idx))


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool, desc_act_perm: torch.Tensor | None = None,
                 min_zero: int = 0) -> QuantizedLinear:
    """w [N, K] float (nn.Linear layout) -> a QuantizedLinear (round to nearest per group).

    Groups are consecutive input rows in ``desc_act_perm`` order (identity when None); rows stay stored in
    input order, so a permutation gives a shuffled g_idx. Scales are rounded to fp16 before the codes are
    chosen, so the packed tensors dequantize exactly to ``dequant``. ``min_zero=1`` keeps asym zeros >= 1,
    which v1 checkpoints need for other readers (AutoGPTQ/vLLM add 1 without wrapping mod 16).
    """
    n, k = w.shape
    if k % 8 or n % 8:
        raise ValueError(f"GPTQ 4-bit needs in/out features divisible by 8, got [{n}, {k}]")
    gs = k if group_size in (-1, 0) else group_size
    perm = torch.arange(k) if desc_act_perm is None else desc_act_perm.long()
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    gl = g_idx.long()
    ng = num_groups(k, group_size)
    wt = w.detach().float().t().contiguous()                               # [K, N]
    scales = torch.empty(ng, n)
    zeros = torch.empty(ng, n)
    for g in range(ng):
        rows = wt[gl == g]                                                  # [rows, N]
        xmin = rows.min(dim=0).values.clamp(max=0.0)                        # the range always holds 0
        xmax = rows.max(dim=0).values.clamp(min=0.0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        span = torch.where(xmax - xmin > 0, xmax - xmin, torch.ones_like(xmax))   # dead column: any scale
        s = (span / MAXQ).half().float()
        s = torch.where(s > 0, s, torch.full_like(s, 2.0**-24))            # fp16 underflow guard
        z = torch.full_like(s, (MAXQ + 1) // 2) if sym else torch.round(-xmin / s).clamp(min_zero, MAXQ)
        scales[g], zeros[g] = s, z
    q = torch.clamp(torch.round(wt / scales[gl]) + zeros[gl], 0, MAXQ).to(torch.int32)   # [K, N]
    zi = zeros.to(torch.int32)
    sc = scales.half()
    dq = (q.long() - zi.long()[gl]).float() * sc.float()[gl]
    return QuantizedLinear(pack_rows(q), pack_cols(zi), sc, g_idx, gs, q, zi, dq)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               fmt: str = "gptq_v2", group_size: int = -1) -> torch.Tensor:
    """On-disk tensors -> float32 W [K, N] (y = x @ W); ``fmt="gptq"`` reads v1 zeros."""
    q = unpack_rows(qweight).long()                                         # [K, N]
    z = unpack_cols(from_v1(qzeros) if fmt == "gptq" else qzeros).long()   # [G, N]
    k = q.shape[0]
    g = (trivial_g_idx(k, group_size) if g_idx is None else g_idx).long()
    return (q - z[g]).float() * scales.float()[g]


# ---------------------------------------------------------------- dynamic overrides
def dynamic_override(dynamic: dict[str, dict[str, Any]] | None, module: str) -> dict[str, Any] | None:
    """GPTQModel's ``dynamic``: the first rule whose regex matches ``module`` (re.match on the module name).

    Returns None for "leave unquantized" (a "-:" rule), else the override dict ({} when nothing matched).
    """
    for pattern, overrides in (dynamic or {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], module):
                return None
        elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, module):
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
            module = name[: -len(".weight")] if name.endswith(".weight") else name
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
