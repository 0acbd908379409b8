"""Load a Hugging Face checkpoint (float safetensors or GPTQ 4-bit) into our model, one shard at a time.

Contract: ``load_model(config, device, dtype) -> model`` with ``model.weights_bytes`` (bytes placed on the
device). Float tensors are cast to ``dtype``; GPTQ tensors stay packed (``GPTQWeight``; v1 zeros are
converted to true zeros, a trivial g_idx becomes None). Which modules are quantized is read from the
tensors present (``.qweight`` vs ``.weight``), so GPTQModel's ``dynamic`` overrides and ``-:`` exclusions
are honoured as written; group sizes come from the scales' shapes. FP8 KV-cache scales (k_scale / v_scale /
kv_scale / k_proj.output_scale ..., as vLLM reads them) set the attention layers' k_scale / v_scale. Experts are stacked per layer into
[E, ...] tensors (float as [E, K, N]); q/k/v (and dense gate/up) are fused when their formats agree.
Host memory holds at most the tensors of the shard being read plus one layer's pending experts.
Every problem raises ``LoadError`` (a ConfigError) naming the tensor or option.
"""
from __future__ import annotations

import logging
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from onecard.checkpoint_meta import shard_names
from onecard.config import ConfigError, ModelConfig
from onecard.kernels.types import GPTQWeight
from onecard.layers.linear import Linear
from onecard.models.qwen3 import is_moe_layer
from onecard.models.registry import get_model_class

logger = logging.getLogger(__name__)

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_DIRECT_COPY_MIN_BYTES = 256 << 10    # experts' parts at least this big go to the device one by one
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# FP8 KV-cache scales, under every name vLLM's maybe_remap_kv_scale_name reads (kv_scale: one for both)
_KV_SCALE = re.compile(r"^self_attn\.(?:attn\.|k_proj\.|v_proj\.)?(k|v|kv)_scale$|^self_attn\.(k|v)_proj\.output_scale$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)$")


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


# ------------------------------------------------------------------------------------------ GPTQ helpers
def _to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def v1_to_true_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ v1 stores zero − 1 per nibble; add 1 (mod 16) to every nibble."""
    shifts = torch.arange(0, 32, 4, device=qzeros.device, dtype=torch.int64)
    z = (qzeros.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF            # [..., N/8, 8]
    z = (z + 1) & 0xF
    return _to_int32((z << shifts).sum(dim=-1))


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
    group_size = -(-k // groups)
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check(f"{name}.g_idx", g_idx, (*qw.shape[:-2], k))
        trivial = torch.arange(k, dtype=torch.int64, device=g_idx.device) // group_size
        if torch.equal(g_idx.to(torch.int64), trivial.expand_as(g_idx)):
            g_idx = None
    qz = qz.to(device)
    if fmt == "gptq":
        qz = v1_to_true_zeros(qz)
    return GPTQWeight(qweight=qw.to(device), qzeros=qz, scales=sc.to(device=device, dtype=torch.float16)
                      if device.type == "cuda" else sc.to(device), g_idx=None if g_idx is None else
                      g_idx.to(device=device, dtype=torch.int32), group_size=group_size, in_features=k,
                      out_features=n)


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


# ------------------------------------------------------------------------------------------ the loader
class _Loader:
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.cfg, self.c = config, config.hf_config
        self.device, self.dtype = device, dtype
        self.fmt = config.quant.checkpoint_format if config.quant else "gptq"
        self.files = shard_files(config.path)
        self.names = read_tensor_names(self.files)
        c = self.c
        self.hidden = int(c["hidden_size"])
        self.L = int(c["num_hidden_layers"])
        self.E = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        self.filled: set[str] = set()
        self.bytes = 0
        self.complete_experts: dict[int, int] = defaultdict(int)     # layer -> complete (expert, proj) entries
        self._expert_need: dict[int, tuple[str, ...]] = {}

    # which linear modules exist in which format
    def module_format(self, name: str) -> str | None:
        if f"{name}.qweight" in self.names:
            return "gptq"
        if f"{name}.weight" in self.names:
            return "float"
        return None

    def fusable(self, names: list[str]) -> bool:
        fmts = {self.module_format(n) for n in names}
        if fmts == {"float"}:
            return True
        if fmts != {"gptq"}:
            return False
        if self.cfg.quant and self.cfg.quant.desc_act:
            return False
        with _open(self.names[f"{names[0]}.scales"]) as h:
            g0 = h.get_slice(f"{names[0]}.scales").get_shape()[0]
        for n in names[1:]:
            with _open(self.names[f"{n}.scales"]) as h:
                if h.get_slice(f"{n}.scales").get_shape()[0] != g0:
                    return False
        return True

    def build(self):
        cls = get_model_class(self.cfg.architecture)
        fuse_qkv, fuse_mlp = [], []
        for i in range(self.L):
            p = f"model.layers.{i}.self_attn"
            fuse_qkv.append(self.fusable([f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]))
            m = f"model.layers.{i}.mlp"
            fuse_mlp.append(not is_moe_layer(self.c, i) and self.fusable([f"{m}.gate_proj", f"{m}.up_proj"]))
        max_pos = max(self.cfg.max_model_len, 1)
        return cls(self.c, max_pos, fuse_qkv, fuse_mlp)

    def place(self, t: torch.Tensor, float_: bool = True) -> torch.Tensor:
        out = t.to(device=self.device, dtype=self.dtype if float_ else t.dtype)
        self.bytes += out.numel() * out.element_size()
        return out

    def load(self):
        model = self.build()
        model.dtype = self.dtype
        model.cos_sin = model.cos_sin.to(self.device)
        pending_linear: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)   # module -> parts
        pending_experts: dict[int, dict] = defaultdict(dict)                      # layer -> (e, proj) -> parts
        show = sys.stderr.isatty()
        bar = tqdm(total=len(self.names), desc="loading weights", unit="tensor", disable=not show)
        for f in self.files:
            with _open(f) as h:
                for key in h.keys():
                    bar.update(1)
                    self.route(model, key, h.get_tensor(key), pending_linear, pending_experts)
        bar.close()
        self.finish_linears(model, pending_linear, final=True)
        self.finish(model)
        model.weights_bytes = self.bytes
        logger.info("placed %.2f GiB of weights on %s", self.bytes / 2**30, self.device)
        return model

    def route(self, model, key, t, pending_linear, pending_experts) -> None:
        if key == "model.embed_tokens.weight":
            _check(key, t, (int(self.c["vocab_size"]), self.hidden))
            model.embed_tokens = self.place(t)
            self.filled.add(key)
            return
        if key == "model.norm.weight":
            model.norm = self.place(t)
            self.filled.add(key)
            return
        if key.startswith("lm_head."):
            pending_linear["lm_head"][key.rsplit(".", 1)[1]] = t
            self.finish_linears(model, pending_linear)
            return
        m = _LAYER.match(key)
        if not m:
            logger.debug("ignoring tensor %s", key)
            return
        i, rest = int(m.group(1)), m.group(2)
        if i >= self.L:
            raise LoadError(f"tensor {key} names layer {i} but the config has {self.L} layers.")
        layer = model.layers[i]
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            _check(key, t, (self.hidden,))
            setattr(layer, rest.split(".")[0], self.place(t))
            self.filled.add(key)
        elif rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            _check(key, t, (layer.self_attn.head_dim,))
            setattr(layer.self_attn, rest.split(".")[1], self.place(t))
            self.filled.add(key)
        elif rest == "mlp.gate.weight" and layer.is_moe:
            _check(key, t, (self.E, self.hidden))
            layer.mlp.gate = self.place(t)
            self.filled.add(key)
        elif (em := _EXPERT.match(rest)) and layer.is_moe:
            e, proj, part = int(em.group(1)), em.group(2), em.group(3)
            if e >= self.E:
                raise LoadError(f"tensor {key} names expert {e} but the config has {self.E} experts.")
            got = pending_experts[i].setdefault((e, proj), {})
            was = self._expert_complete(i, e, proj, got)
            got[part] = t
            if not was and self._expert_complete(i, e, proj, got):
                self.complete_experts[i] += 1
            self.maybe_finish_experts(model, i, pending_experts)
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") and layer.is_moe:
            # transformers 5 fused layout: gate_up [E, 2I, H], down [E, H, I] (nn.Linear style [N, K])
            pending_experts[i][rest] = t
            self.maybe_finish_experts(model, i, pending_experts)
        elif sm := _KV_SCALE.match(rest):
            # per-layer (a per-head vector is reduced to its max: no head overflows); used by fp8 KV caches
            which = sm.group(1) or sm.group(2)
            value = float(t.float().max())
            if not 0 < value < float("inf"):                              # also refuses NaN
                raise LoadError(f"tensor {key} = {value}: a KV-cache scale must be positive and finite.")
            for kv in ("k", "v") if which == "kv" else (which,):
                setattr(layer.self_attn, f"{kv}_scale", value)
                layer.self_attn.kv_scales_from_checkpoint.add(kv)
        elif rest.startswith(("self_attn.", "mlp.")):
            mod, part = rest.rsplit(".", 1)
            pending_linear[f"model.layers.{i}.{mod}"][part] = t
            self.finish_linears(model, pending_linear)
        else:
            logger.debug("ignoring tensor %s", key)

    # --------------------------------------------------------------------- dense linears (+ fusion)
    def _linear_groups(self, model) -> list[tuple[Linear, list[str]]]:
        groups = []
        for i, layer in enumerate(model.layers):
            a, p = layer.self_attn, f"model.layers.{i}.self_attn"
            if a.fuse_qkv:
                groups.append((a.qkv_proj, [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]))
            else:
                groups += [(a.q_proj, [f"{p}.q_proj"]), (a.k_proj, [f"{p}.k_proj"]), (a.v_proj, [f"{p}.v_proj"])]
            groups.append((a.o_proj, [f"{p}.o_proj"]))
            if not layer.is_moe:
                mp, m = layer.mlp, f"model.layers.{i}.mlp"
                if mp.fuse:
                    groups.append((mp.gate_up_proj, [f"{m}.gate_proj", f"{m}.up_proj"]))
                else:
                    groups += [(mp.gate_proj, [f"{m}.gate_proj"]), (mp.up_proj, [f"{m}.up_proj"])]
                groups.append((mp.down_proj, [f"{m}.down_proj"]))
        groups.append((model.lm_head, ["lm_head"]))
        return groups

    def finish_linears(self, model, pending, final: bool = False) -> None:
        if not hasattr(self, "_groups"):
            self._groups = {n: (lin, names) for lin, names in self._linear_groups(model) for n in names}
        done: list[str] = []
        for name in list(pending):
            if name in done:          # already built as part of its fused group in this call
                continue
            if name not in self._groups:
                raise LoadError(f"unexpected tensors for module {name} (not part of the model).")
            lin, names = self._groups[name]
            if not all(self._complete(n, pending.get(n, {})) for n in names):
                continue
            parts = [pending[n] for n in names]
            sizes = [self._out_features(model, n) for n in names]
            k = lin.in_features
            if all("qweight" in p for p in parts):
                ws = [_gptq_weight(p, n, k, s, self.fmt, self.device) for p, n, s in zip(parts, names, sizes)]
                lin.gptq = ws[0] if len(ws) == 1 else _concat_gptq(ws)
                self.bytes += lin.gptq.nbytes()
            else:
                for p, n, s in zip(parts, names, sizes):
                    if "weight" not in p:
                        raise LoadError(f"missing tensor {n}.weight")
                    _check(f"{n}.weight", p["weight"], (s, k))
                lin.weight = self.place(torch.cat([p["weight"] for p in parts], 0))
            if any("bias" in p for p in parts):
                lin.bias = self.place(torch.cat([p["bias"] for p in parts], 0))
            done += names
        for n in done:
            pending.pop(n, None)
            self.filled.add(n)

    def _complete(self, name: str, parts: dict) -> bool:
        want = [f"{name}.{p}" for p in (("qweight", "qzeros", "scales") if self.module_format(name) == "gptq"
                                        else ("weight",))]
        want += [f"{name}.bias"] if f"{name}.bias" in self.names else []
        want += [f"{name}.g_idx"] if f"{name}.g_idx" in self.names else []
        return all(w.rsplit(".", 1)[1] in parts for w in want)

    def _out_features(self, model, name: str) -> int:
        a = model.layers[0].self_attn
        short = name.rsplit(".", 1)[-1]
        c = self.c
        return {"q_proj": a.q_size, "k_proj": a.kv_size, "v_proj": a.kv_size, "o_proj": self.hidden,
                "gate_proj": int(c.get("intermediate_size", 0)), "up_proj": int(c.get("intermediate_size", 0)),
                "down_proj": self.hidden, "lm_head": int(c["vocab_size"])}[short]

    # --------------------------------------------------------------------- experts
    def _expert_parts(self, i: int) -> tuple[str, ...]:
        """The parts every expert projection of layer i needs (its format is expert 0's gate_proj's)."""
        if i not in self._expert_need:
            p0 = f"model.layers.{i}.mlp.experts.0.gate_proj"
            self._expert_need[i] = ("qweight", "qzeros", "scales") if self.module_format(p0) == "gptq" else ("weight",)
        return self._expert_need[i]

    def _expert_complete(self, i: int, e: int, proj: str, got: dict) -> bool:
        """Has (expert e, proj) of layer i every part the checkpoint holds for it? (O(1): no scan of the
        other experts, so a layer's 3E x 3-4 tensors cost linear time.)"""
        if not all(n in got for n in self._expert_parts(i)):
            return False
        return "g_idx" in got or f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.g_idx" not in self.names

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

    def maybe_finish_experts(self, model, i: int, pending) -> None:
        parts = pending[i]
        moe = model.layers[i].mlp
        inter = int(self.c["moe_intermediate_size"])
        h = self.hidden
        if "mlp.experts.gate_up_proj" in parts and "mlp.experts.down_proj" in parts:
            gu, dn = parts.pop("mlp.experts.gate_up_proj"), parts.pop("mlp.experts.down_proj")
            _check(f"model.layers.{i}.mlp.experts.gate_up_proj", gu, (self.E, 2 * inter, h))
            _check(f"model.layers.{i}.mlp.experts.down_proj", dn, (self.E, h, inter))
            moe.w_gate = self.place(gu[:, :inter].transpose(1, 2).contiguous())
            moe.w_up = self.place(gu[:, inter:].transpose(1, 2).contiguous())
            moe.w_down = self.place(dn.transpose(1, 2).contiguous())
            self.filled.add(f"model.layers.{i}.experts")
            return
        if self.complete_experts[i] != 3 * self.E:       # route() counts complete (expert, proj) entries
            return
        gptq = "qweight" in self._expert_parts(i)
        for proj, (k, n) in (("gate", (h, inter)), ("up", (h, inter)), ("down", (inter, h))):
            per = [parts.pop((e, proj)) for e in range(self.E)]
            base = f"model.layers.{i}.mlp.experts.*.{proj}_proj"
            if gptq:
                stacked = {p: self._stack([x[p] for x in per], f"{base}.{p}") for p in GPTQ_PARTS if p in per[0]}
                w = _gptq_weight(stacked, base, k, n, self.fmt, self.device)
                self.bytes += w.nbytes()
            else:
                for e, x in enumerate(per):
                    _check(base.replace("*", str(e)) + ".weight", x["weight"], (n, k))
                w = self.place(torch.stack([x["weight"] for x in per]).transpose(1, 2).contiguous())  # [E, K, N]
            setattr(moe, f"w_{proj}", w)
        self.filled.add(f"model.layers.{i}.experts")

    # --------------------------------------------------------------------- completeness
    def finish(self, model) -> None:
        if model.lm_head.weight is None and model.lm_head.gptq is None:
            if self.c.get("tie_word_embeddings", False) and model.embed_tokens is not None:
                model.lm_head.weight = model.embed_tokens
            else:
                raise LoadError("missing tensor lm_head.weight (and tie_word_embeddings is false).")
        missing = []
        if model.embed_tokens is None:
            missing.append("model.embed_tokens.weight")
        if model.norm is None:
            missing.append("model.norm.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}"
            for attr, name in ((layer.input_layernorm, "input_layernorm.weight"),
                               (layer.post_attention_layernorm, "post_attention_layernorm.weight"),
                               (layer.self_attn.q_norm, "self_attn.q_norm.weight"),
                               (layer.self_attn.k_norm, "self_attn.k_norm.weight")):
                if attr is None:
                    missing.append(f"{p}.{name}")
            if layer.is_moe:
                if layer.mlp.gate is None:
                    missing.append(f"{p}.mlp.gate.weight")
                if layer.mlp.w_down is None:
                    missing.append(f"{p}.mlp.experts (some expert tensors)")
        for lin, names in self._linear_groups(model):
            if lin.weight is None and lin.gptq is None and names != ["lm_head"]:
                missing.append(f"{names[0]}.weight (or .qweight)")
        if missing:
            raise LoadError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + f" in {self.cfg.path}.")


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype):
    if isinstance(device, str):
        device = torch.device(device)
    model = _Loader(config, device, dtype).load()
    return model.eval()
