"""Load a Hugging Face checkpoint (float safetensors or GPTQ 4-bit) into our model, one shard at a time.

Contract: ``load_model(config, device, dtype) -> model`` with ``model.weights_bytes`` (bytes placed on the
device). Float tensors are cast to ``dtype``; GPTQ tensors stay packed (``GPTQWeight``; v1 zeros are
converted to true zeros, a trivial g_idx becomes None). Which modules are quantized is read from the
tensors present (``.qweight`` vs ``.weight``), so GPTQModel's ``dynamic`` overrides and ``-:`` exclusions
are honoured as written; group sizes come from the scales' shapes. Which tensor fills which parameter (names,
shapes, fused projections, stacked experts, completeness) is the model's declaration (``weight_specs``,
models/weights.py); this file answers ``can_fuse`` from the formats (all float, or GPTQ with one group layout
and no act-order), iterates the shards, routes each tensor to its spec and assembles float and GPTQ tensors
(experts stacked [E, ...], float as [E, K, N]; the GPTQ format is ``kernels/gptq_gemm/format.py``'s).
FP8 KV-cache scales (k_scale / v_scale / kv_scale / k_proj.output_scale ..., the names vLLM reads) set the
attention layers' k_scale / v_scale (a per-head vector is reduced to its max, so no head overflows).
Host memory holds at most the tensors of the shard being read plus one layer's pending experts.
Every problem raises ``LoadError`` (a ConfigError) naming the tensor or option.
"""
from __future__ import annotations

import logging
import re
import sys
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import torch
from tqdm import tqdm

from onecard.checkpoint_meta import shard_names
from onecard.config import ConfigError, ModelConfig
from onecard.kernels.gptq_gemm import format as gptq_format
from onecard.kernels.types import GPTQWeight
from onecard.models.registry import get_model_class
from onecard.models.weights import ExpertsSpec, LinearSpec, Param, Spec, missing_weights

logger = logging.getLogger(__name__)

_DIRECT_COPY_MIN_BYTES = 256 << 10    # experts' parts at least this big go to the device one by one


# FP8 KV-cache scales, under every name vLLM's maybe_remap_kv_scale_name reads (kv_scale: one for both)
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:(?:attn\.|k_proj\.|v_proj\.)?(k|v|kv)_scale"
                       r"|(k|v)_proj\.output_scale)$")


class LoadError(ConfigError):
    """A checkpoint that cannot be loaded; the message names the tensor or option."""


def shard_files(path: Path) -> list[Path]:
    return [path / name for name in shard_names(path)]


def _open(f: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except FileNotFoundError:
        raise LoadError(f"safetensors file {f} is missing (named in the index).") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad header
        raise LoadError(f"cannot read the safetensors header of {f}: {e}") from None


def read_tensor_names(files: list[Path]) -> dict[str, Path]:
    names: dict[str, Path] = {}
    for f in files:
        with _open(f) as h:
            for k in h.keys():
                names[k] = f
    return names


# ------------------------------------------------------------------------------------------ GPTQ assembly
def _gptq_weight(parts: dict[str, torch.Tensor], name: str, k: int, n: int, fmt: str,
                 device: torch.device) -> GPTQWeight:
    for p in ("qweight", "qzeros", "scales"):
        if p not in parts:
            raise LoadError(f"missing tensor {name}.{p} (GPTQ module needs qweight, qzeros, scales).")
    qw, qz, sc = parts["qweight"], parts["qzeros"], parts["scales"]
    _check(f"{name}.qweight", qw, (*qw.shape[:-2], k // 8, n))
    groups = sc.shape[-2]
    _check(f"{name}.scales", sc, (*qw.shape[:-2], groups, n))
    _check(f"{name}.qzeros", qz, (*qw.shape[:-2], groups, n // 8))
    if qw.dtype != torch.int32 or qz.dtype != torch.int32:
        raise LoadError(f"{name}: qweight/qzeros must be int32 (pack_dtype int32), got {qw.dtype}/{qz.dtype}.")
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check(f"{name}.g_idx", g_idx, (*qw.shape[:-2], k))
    sc = sc.to(device=device, dtype=torch.float16) if device.type == "cuda" else sc.to(device)
    w = gptq_format.from_disk(qw.to(device), qz.to(device), sc, g_idx, fmt, k)   # g_idx checked where it is
    if w.g_idx is not None:
        w.g_idx = w.g_idx.to(device)
    return w


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise LoadError(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}.")


def _concat_gptq(ws: list[GPTQWeight]) -> GPTQWeight:
    gi = [w.g_idx for w in ws]
    if any(g is not None for g in gi) and not all(g is not None and torch.equal(g, gi[0]) for g in gi):
        raise LoadError("internal: fused GPTQ modules with different g_idx")
    return GPTQWeight(torch.cat([w.qweight for w in ws], -1), torch.cat([w.qzeros for w in ws], -1),
                      torch.cat([w.scales for w in ws], -1), gi[0], ws[0].group_size, ws[0].in_features,
                      sum(w.out_features for w in ws))


# ------------------------------------------------------------------------------------------ assembly
class WeightAssembler:
    """Routes checkpoint tensors to a model's declared specs (models/weights.py) and places them on the device.

    ``add(key, tensor)`` in any order; a Linear is built when all its modules' parts have arrived, a layer's
    experts when all (expert, projection) entries are complete (counted per tensor, no rescans). ``names``: every
    tensor name the checkpoint holds (optional parts such as g_idx or bias are awaited only when present).
    Keys no spec owns are ignored, except under ``strict_prefixes`` (then they are an error).
    """

    def __init__(self, specs: list[Spec], names: Collection[str], fmt: str, device: torch.device,
                 dtype: torch.dtype, strict_prefixes: tuple[str, ...] = ()):
        self.names, self.fmt, self.device, self.dtype = names, fmt, device, dtype
        self.strict = strict_prefixes
        self.params = {s.key: s for s in specs if isinstance(s, Param)}
        self.linears = {m: s for s in specs if isinstance(s, LinearSpec) for m in s.modules}
        self.experts = {s.prefix: s for s in specs if isinstance(s, ExpertsSpec)}
        self.pending_linear: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)   # module -> parts
        self.pending_experts: dict[str, dict] = defaultdict(dict)        # prefix -> (e, proj) | fused name -> parts
        self.complete_experts: dict[str, int] = defaultdict(int)         # prefix -> complete (expert, proj) entries
        self._expert_need: dict[str, tuple[str, ...]] = {}
        self.bytes = 0

    def module_format(self, name: str) -> str | None:
        if f"{name}.qweight" in self.names:
            return "gptq"
        if f"{name}.weight" in self.names:
            return "float"
        return None

    def place(self, t: torch.Tensor, float_: bool = True) -> torch.Tensor:
        out = t.to(device=self.device, dtype=self.dtype if float_ else t.dtype)
        self.bytes += out.numel() * out.element_size()
        return out

    def add(self, key: str, t: torch.Tensor) -> None:
        if (p := self.params.get(key)) is not None:
            _check(key, t, p.shape)
            setattr(p.owner, p.attr, self.place(t))
            return
        module, _, part = key.rpartition(".")
        if (lin := self.linears.get(module)) is not None:
            self.pending_linear[module][part] = t
            self.finish_linear(lin)
            return
        if (ex := self.experts.get(module)) is not None and part in ex.fused:     # transformers-5 fused layout
            self.pending_experts[ex.prefix][part] = t
            self.maybe_finish_experts(ex)
            return
        head = key.rsplit(".", 3)                                 # prefix, expert, proj, part
        if len(head) == 4 and (ex := self.experts.get(head[0])) is not None and head[1].isdigit():
            self.add_expert(ex, key, int(head[1]), head[2], head[3], t)
            return
        if key.startswith(self.strict):
            raise LoadError(f"unexpected tensor {key} (not part of the model: check num_hidden_layers, "
                            "num_experts and the layer types in config.json).")
        logger.debug("ignoring tensor %s", key)

    # --------------------------------------------------------------------- dense linears (+ fusion)
    def finish_linear(self, spec: LinearSpec) -> None:
        if not all(self._complete(n, self.pending_linear.get(n, {})) for n in spec.modules):
            return
        parts = [self.pending_linear.pop(n) for n in spec.modules]
        lin, k = spec.linear, spec.linear.in_features
        if all("qweight" in p for p in parts):
            ws = [_gptq_weight(p, n, k, s, self.fmt, self.device)
                  for p, n, s in zip(parts, spec.modules, spec.out_features)]
            lin.gptq = ws[0] if len(ws) == 1 else _concat_gptq(ws)
            self.bytes += lin.gptq.nbytes()
        else:
            for p, n, s in zip(parts, spec.modules, spec.out_features):
                if "weight" not in p:
                    raise LoadError(f"missing tensor {n}.weight")
                _check(f"{n}.weight", p["weight"], (s, k))
            lin.weight = self.place(torch.cat([p["weight"] for p in parts], 0))
        if any("bias" in p for p in parts):
            lin.bias = self.place(torch.cat([p["bias"] for p in parts], 0))

    def _complete(self, name: str, parts: dict) -> bool:
        want = ["qweight", "qzeros", "scales"] if self.module_format(name) == "gptq" else ["weight"]
        want += [p for p in ("bias", "g_idx") if f"{name}.{p}" in self.names]
        return all(w in parts for w in want)

    # --------------------------------------------------------------------- experts
    def _expert_parts(self, ex: ExpertsSpec) -> tuple[str, ...]:
        """The parts every expert projection needs (its format is expert 0's first projection's)."""
        if ex.prefix not in self._expert_need:
            gptq = self.module_format(f"{ex.prefix}.0.{ex.projs[0].name}") == "gptq"
            self._expert_need[ex.prefix] = ("qweight", "qzeros", "scales") if gptq else ("weight",)
        return self._expert_need[ex.prefix]

    def _expert_complete(self, ex: ExpertsSpec, e: int, proj: str, got: dict) -> bool:
        """Has (expert e, proj) every part the checkpoint holds for it? (O(1): no scan of the other experts,
        so a layer's 3E x 3-4 tensors cost linear time.)"""
        if not all(n in got for n in self._expert_parts(ex)):
            return False
        return "g_idx" in got or f"{ex.prefix}.{e}.{proj}.g_idx" not in self.names

    def add_expert(self, ex: ExpertsSpec, key: str, e: int, proj: str, part: str, t: torch.Tensor) -> None:
        if e >= ex.num_experts:
            raise LoadError(f"tensor {key} names expert {e} but the config has {ex.num_experts} experts.")
        if all(p.name != proj for p in ex.projs):
            raise LoadError(f"unexpected tensor {key} (the experts have {', '.join(p.name for p in ex.projs)}).")
        got = self.pending_experts[ex.prefix].setdefault((e, proj), {})
        was = self._expert_complete(ex, e, proj, got)
        got[part] = t
        if not was and self._expert_complete(ex, e, proj, got):
            self.complete_experts[ex.prefix] += 1
        self.maybe_finish_experts(ex)

    def _stack(self, parts: list[torch.Tensor], name: str) -> torch.Tensor:
        """torch.stack(parts) built on the load device: each expert's tensor is copied from the checkpoint's
        memory map straight into its slice (no host-side stacked copy, which was a second pass over the
        layer's bytes); parts under _DIRECT_COPY_MIN_BYTES are stacked on the host and copied once (a copy
        costs ~10 us of fixed overhead). Dtypes are kept (_gptq_weight casts the scales as before)."""
        first = parts[0]
        for e, x in enumerate(parts):
            if x.shape != first.shape or x.dtype != first.dtype:
                raise LoadError(f"{name.replace('*', str(e))}: shape {list(x.shape)} {x.dtype} differs from "
                                f"expert 0's {list(first.shape)} {first.dtype}.")
        if first.numel() * first.element_size() < _DIRECT_COPY_MIN_BYTES:
            return torch.stack(parts).to(self.device)      # small parts (scales, zeros): one copy, not E
        out = torch.empty((len(parts), *first.shape), dtype=first.dtype, device=self.device)
        for e, x in enumerate(parts):
            out[e].copy_(x)
        return out

    def maybe_finish_experts(self, ex: ExpertsSpec) -> None:
        parts = self.pending_experts[ex.prefix]
        if ex.fused and all(f in parts for f in ex.fused):
            for fname, names in ex.fused.items():                  # [E, sum N_i, K] (nn.Linear style)
                t = parts.pop(fname)
                projs = [ex.proj(n) for n in names]
                _check(f"{ex.prefix}.{fname}", t, (ex.num_experts, sum(p.out_features for p in projs),
                                                   projs[0].in_features))
                for p, w in zip(projs, t.split([p.out_features for p in projs], dim=1)):
                    setattr(ex.owner, p.attr, self.place(w.transpose(1, 2).contiguous()))     # [E, K, N]
            return
        if self.complete_experts[ex.prefix] != len(ex.projs) * ex.num_experts:
            return
        gptq = "qweight" in self._expert_parts(ex)
        for p in ex.projs:
            per = [parts.pop((e, p.name)) for e in range(ex.num_experts)]
            base = f"{ex.prefix}.*.{p.name}"
            if gptq:
                stacked = {q: self._stack([x[q] for x in per], f"{base}.{q}")
                           for q in gptq_format.GPTQ_PARTS if q in per[0]}
                w = _gptq_weight(stacked, base, p.in_features, p.out_features, self.fmt, self.device)
                self.bytes += w.nbytes()
            else:
                for e, x in enumerate(per):
                    _check(base.replace("*", str(e)) + ".weight", x["weight"], (p.out_features, p.in_features))
                w = self.place(torch.stack([x["weight"] for x in per]).transpose(1, 2).contiguous())  # [E, K, N]
            setattr(ex.owner, p.attr, w)


# ------------------------------------------------------------------------------------------ the loader
def _fusable(cfg: ModelConfig, names: dict[str, Path], modules: list[str]) -> bool:
    """May these checkpoint modules be one Linear? All float, or all GPTQ with one group layout."""
    fmts = {"gptq" if f"{n}.qweight" in names else "float" if f"{n}.weight" in names else None for n in modules}
    if fmts == {"float"}:
        return True
    if fmts != {"gptq"} or (cfg.quant and cfg.quant.desc_act):
        return False
    groups = set()
    for n in modules:
        with _open(names[f"{n}.scales"]) as h:
            groups.add(h.get_slice(f"{n}.scales").get_shape()[0])
    return len(groups) == 1


def _set_kv_scale(model, key: str, m: re.Match, t: torch.Tensor) -> None:
    i, which = int(m.group(1)), m.group(2) or m.group(3)
    if i >= len(model.layers):
        raise LoadError(f"tensor {key} names layer {i} but the config has {len(model.layers)} layers.")
    value = float(t.float().max())
    if not 0 < value < float("inf"):                                      # also refuses NaN
        raise LoadError(f"tensor {key} = {value}: a KV-cache scale must be positive and finite.")
    attn = model.layers[i].self_attn
    for kv in ("k", "v") if which == "kv" else (which,):
        setattr(attn, f"{kv}_scale", value)
        attn.kv_scales_from_checkpoint.add(kv)


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype):
    """Build the model (fusion decided from the checkpoint's formats), stream every shard into it, check that
    every declared weight arrived."""
    if isinstance(device, str):
        device = torch.device(device)
    files = shard_files(config.path)
    names = read_tensor_names(files)
    cls = get_model_class(config.architecture)
    model = cls(config.hf_config, max(config.max_model_len, 1), lambda mods: _fusable(config, names, mods))
    model.set_device(device, dtype)
    specs = model.weight_specs()
    fmt = config.quant.checkpoint_format if config.quant else "gptq"
    asm = WeightAssembler(specs, names, fmt, device, dtype, strict_prefixes=model.strict_prefixes)
    bar = tqdm(total=len(names), desc="loading weights", unit="tensor", disable=not sys.stderr.isatty())
    for f in files:
        with _open(f) as h:
            for key in h.keys():
                bar.update(1)
                if m := _KV_SCALE.match(key):
                    _set_kv_scale(model, key, m, h.get_tensor(key))
                    continue
                asm.add(key, h.get_tensor(key))
    bar.close()
    model.tie_weights()
    missing = missing_weights(specs)
    if missing:
        raise LoadError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                                          else "") + f" in {config.path}.")
    model.weights_bytes = asm.bytes
    logger.info("placed %.2f GiB of weights on %s", asm.bytes / 2**30, device)
    return model.eval()
