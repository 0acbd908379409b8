"""Qwen3 (dense) and Qwen3-MoE causal LMs: our modules, calling kernels through ``dispatch``.

Contract: ``forward(input_ids[T], positions[T], kv_caches, md, layer_ids=None) -> hidden[T, H]`` over a
flattened variable-length batch (see kernels/attention/metadata.py; ``layer_ids``: a subset of the layers, for
dry forwards); ``compute_logits(hidden[B, H]) -> [B, V]`` fp32.
Weights: ``weight_specs()`` declares which checkpoint tensor fills which parameter (names, shapes, fused q/k/v and
gate/up, stacked experts; see models/weights.py); models/loader.py places them.
Per layer: RMSNorm(+residual) → qkv → per-head q/k RMSNorm + RoPE, K/V into the cache → paged attention → o_proj
(with fused q/k/v one op, ``attention_block``, whose batch-1 path may return fp32 sums) →
RMSNorm(+residual) → MLP (dense SiLU-gated, or sparse MoE: router → softmax → top-k → renormalise → experts; the
MoE layer calls the norm and the experts as one op, ``norm_moe``, which its batch-1 kernels fuse).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onecard.kernels import dispatch as ops
from onecard.kernels import paths
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.fused_moe import router_fold
from onecard.kernels.fused_moe.router_fold import RouterFold
from onecard.kernels.types import MoEWeight
from onecard.layers.kv_prefetch import KvPrefetch
from onecard.layers.linear import Linear
from onecard.layers.rotary import rope_cache
from onecard.models.weights import ExpertProj, ExpertsSpec, LinearSpec, Param, Spec


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any], fuse_qkv: bool):
        super().__init__()
        self.num_heads = int(c["num_attention_heads"])
        self.num_kv_heads = int(c.get("num_key_value_heads", self.num_heads))
        self.head_dim = int(c.get("head_dim") or c["hidden_size"] // self.num_heads)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        h = int(c["hidden_size"])
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.fuse_qkv = fuse_qkv
        if fuse_qkv:
            self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size)
        else:
            self.q_proj = Linear(h, self.q_size)
            self.k_proj = Linear(h, self.kv_size)
            self.v_proj = Linear(h, self.kv_size)
        self.o_proj = Linear(self.q_size, h)
        self.q_norm: torch.Tensor | None = None   # [D]
        self.k_norm: torch.Tensor | None = None   # [D]
        self.scale = self.head_dim ** -0.5
        # fp8 KV cache: stored = value / scale (kv_dtype.py); the checkpoint's, else 1.0 (the runner warns)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scales_from_checkpoint: set[str] = set()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        """x [T, H]: the normalised input -> [T, H]."""
        t = x.shape[0]
        if self.fuse_qkv:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)                  # [T, Hq, D] (rows strided in qkv)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)               # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)               # [T, Hkv, D]
        k_cache, v_cache = kv_cache
        q = ops.qk_norm_rope_store(q, k, v, self.q_norm, self.k_norm, positions, cos_sin, self.eps, k_cache,
                                   v_cache, md.slot_mapping, self.k_scale, self.v_scale)   # k, v -> the cache
        return self._attend(q, kv_cache, md)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                         md: AttentionMetadata, router_fold: RouterFold | None = None) -> tuple:
        """The layer's input RMSNorm (``norm_weight``, residual add), then ``forward`` -> (out [T, H],
        residual_out [T, H]); with fused q/k/v one op (attention_block; out may be fp32 sums at batch 1).
        ``router_fold`` given (fused q/k/v only): (out, residual_out, FoldedRoute | None), as attention_block."""
        if not self.fuse_qkv:
            h, residual = ops.rms_norm(x, norm_weight, self.eps, residual)
            return self.forward(h, positions, cos_sin, kv_cache, md), residual
        lin, o = self.qkv_proj, self.o_proj
        k_cache, v_cache = kv_cache
        return ops.attention_block(x, residual, norm_weight, self.eps,
                                   lin.gptq if lin.gptq is not None else lin.weight, lin.bias, self.q_norm,
                                   self.k_norm, positions, cos_sin, k_cache, v_cache, md, self.scale,
                                   o.gptq if o.gptq is not None else o.weight, o.bias, self.k_scale, self.v_scale,
                                   router_fold=router_fold)

    def _attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] (normalised, rotated; this step's k/v in the cache) -> o_proj(attention) [T, H]."""
        o = ops.paged_attention(q, kv_cache[0], kv_cache[1], md, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(o.reshape(q.shape[0], self.q_size))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, fuse: bool):
        super().__init__()
        self.fuse = fuse
        if fuse:
            self.gate_up_proj = Linear(hidden, 2 * inter)
        else:
            self.gate_proj = Linear(hidden, inter)
            self.up_proj = Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x) if self.fuse else torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(ops.silu_and_mul(gu))


class SparseMoE(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.num_experts = int(c.get("num_experts") or c.get("num_local_experts"))
        self.top_k = int(c["num_experts_per_tok"])
        self.renormalize = bool(c.get("norm_topk_prob", False))
        self.gate: torch.Tensor | None = None    # router [E, H], float
        self.w_gate: MoEWeight | None = None     # [E, H, I] or GPTQ
        self.w_up: MoEWeight | None = None       # [E, H, I] or GPTQ
        self.w_down: MoEWeight | None = None     # [E, I, H] or GPTQ
        self.router_fold: RouterFold | None = None   # batch 1: the router folded into o_proj (DecoderLayer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = ops.moe_router(x, self.gate)                      # [T, E]
        return ops.fused_moe(x, router_logits, self.w_gate, self.w_up, self.w_down, self.top_k, self.renormalize)


class DecoderLayer(nn.Module):
    def __init__(self, c: dict[str, Any], layer_idx: int, fuse_qkv: bool, fuse_mlp: bool):
        super().__init__()
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.self_attn = Attention(c, fuse_qkv)
        self.is_moe = is_moe_layer(c, layer_idx)
        if self.is_moe:
            self.mlp: nn.Module = SparseMoE(c)
        else:
            self.mlp = DenseMLP(int(c["hidden_size"]), int(c["intermediate_size"]), fuse_mlp)
        self.input_layernorm: torch.Tensor | None = None
        self.post_attention_layernorm: torch.Tensor | None = None

    def forward(self, x, residual, positions, cos_sin, kv_cache, md, after_attention: Callable[[], None] | None = None):
        """``after_attention``: called once the attention block has run, before the MLP (the forward's KV
        prefetch, layers/kv_prefetch.py)."""
        fold = self._router_fold(x)                                       # the router inside o_proj's launch
        h, residual, *handed = self.self_attn.forward_residual(x, residual, self.input_layernorm, positions, cos_sin,
                                                               kv_cache, md, router_fold=fold)
        if after_attention is not None:
            after_attention()
        if self.is_moe:                                                   # norm + router + experts: one op
            m = self.mlp
            return ops.norm_moe(h, residual, self.post_attention_layernorm, self.eps, m.gate, m.w_gate, m.w_up,
                                m.w_down, m.top_k, m.renormalize, folded=handed[0] if handed else None)
        h, residual = ops.rms_norm(h, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(h), residual

    def folds_router(self, tokens: int, device: torch.device) -> bool:
        """Does a ``tokens``-token forward on ``device`` fold this layer's router into o_proj
        (fused_moe/router_fold.py): an MoE layer, paths.batch1_router_fold, the Triton backend, fused q/k/v, a GPTQ
        o_proj without bias?"""
        a = self.self_attn
        return (self.is_moe and paths.batch1_router_fold(tokens) and a.fuse_qkv and a.o_proj.gptq is not None
                and a.o_proj.bias is None and ops.backend_for(device) == "triton")

    def build_router_fold(self) -> RouterFold:
        m = self.mlp
        if m.router_fold is None:
            m.router_fold = router_fold.build(m.gate, self.post_attention_layernorm, self.self_attn.o_proj.gptq)
        return m.router_fold

    def _router_fold(self, x: torch.Tensor) -> RouterFold | None:
        """This MoE layer's folded router where this step may use it (``folds_router``): the runner builds them
        after loading (Qwen3ForCausalLM.build_router_folds); a process that turns the switch on later builds them
        on first use, outside a CUDA-graph capture (the capture's warm-up forwards run first)."""
        if not self.folds_router(x.shape[0], x.device):
            return None
        if self.mlp.router_fold is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return self.build_router_fold()


def is_moe_layer(c: dict[str, Any], i: int) -> bool:
    if not (c.get("num_experts") or c.get("num_local_experts")):
        return False
    if i in (c.get("mlp_only_layers") or []):
        return False
    step = int(c.get("decoder_sparse_step", 1) or 1)
    return (i + 1) % step == 0


class Qwen3ForCausalLM(nn.Module):
    """Also Qwen3-MoE: the layer type follows the config (``is_moe_layer``)."""

    strict_prefixes = ("model.layers.", "lm_head.")     # checkpoint tensors here must be declared weights
    # GPTQ's "true sequential" order within a layer: each group's inputs are recorded with the earlier ones quantized
    sequential_modules = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))

    def __init__(self, c: dict[str, Any], max_positions: int,
                 can_fuse: Callable[[list[str]], bool] = lambda modules: True):
        """``can_fuse(checkpoint module names)``: may these be one Linear (the loader knows their formats)."""
        super().__init__()
        self.config = c
        self.num_layers = int(c["num_hidden_layers"])
        layers = []
        for i in range(self.num_layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            fuse_qkv = can_fuse([f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            fuse_mlp = not is_moe_layer(c, i) and can_fuse([f"{m}.gate_proj", f"{m}.up_proj"])
            layers.append(DecoderLayer(c, i, fuse_qkv, fuse_mlp))
        self.layers = nn.ModuleList(layers)
        self.embed_tokens: torch.Tensor | None = None    # [V, H]
        self.norm: torch.Tensor | None = None             # [H]
        self.lm_head = Linear(int(c["hidden_size"]), int(c["vocab_size"]))  # the embedding when tied
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        a = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = a.num_kv_heads, a.head_dim
        self.cos_sin = rope_cache(c, a.head_dim, max_positions)            # [P, D] fp32
        self.dtype = torch.float32
        self.weights_bytes = 0
        # layers/kv_prefetch.py's side stream and its sums buffers (positions -> [positions / chunk] fp32): first use
        self.kv_prefetch_stream: Any = None
        self.kv_prefetch_sums: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md: AttentionMetadata,
                layer_ids: Sequence[int] | None = None) -> torch.Tensor:
        """``layer_ids``: run only these decoder layers, each on its own cache (the precompile's dry forward:
        identical layers launch identical kernels, so one of each kind records them all). None: every layer."""
        x = F.embedding(input_ids, self.embed_tokens)                      # [T, H]
        residual = None
        pairs = list(zip(self.layers, kv_caches) if layer_ids is None
                     else ((self.layers[i], kv_caches[i]) for i in layer_ids))
        # batch 1: each next layer's KV read into L2 during this layer's MoE (paths.batch1_kv_prefetch; None: off)
        prefetch = KvPrefetch.for_step(self, input_ids, [kv for _, kv in pairs], md)
        for j, (layer, kv) in enumerate(pairs):
            x, residual = layer(x, residual, positions, self.cos_sin, kv, md,
                                None if prefetch is None else partial(prefetch.after_attention, j))
        if prefetch is not None:
            prefetch.join()
        x, _ = ops.rms_norm(x, self.norm, self.eps, residual)
        return x

    def build_router_folds(self, device: torch.device) -> int:
        """Build the folded router of every layer that batch 1 on ``device`` folds (DecoderLayer.folds_router), now:
        the runner calls this after loading, before its memory profile sizes the KV cache, so that it counts
        their bytes (72 MB at the served shape). -> their bytes."""
        n = 0
        for layer in self.layers:
            if layer.folds_router(1, device):
                f = layer.build_router_fold()
                n += f.f.numel() * f.f.element_size() + f.m.numel() * f.m.element_size()
        return n

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                                # [B, V]

    # ------------------------------------------------------------------ weights
    def weight_specs(self) -> list[Spec]:
        """Every checkpoint tensor this model reads (HF Qwen3 / Qwen3-MoE names), in declaration order."""
        c = self.config
        h, v = int(c["hidden_size"]), int(c["vocab_size"])
        specs: list[Spec] = [Param("model.embed_tokens.weight", (v, h), self, "embed_tokens"),
                             Param("model.norm.weight", (h,), self, "norm")]
        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}", layer.self_attn
            specs += [Param(f"{p}.input_layernorm.weight", (h,), layer, "input_layernorm", i),
                      Param(f"{p}.post_attention_layernorm.weight", (h,), layer, "post_attention_layernorm", i),
                      Param(f"{p}.self_attn.q_norm.weight", (a.head_dim,), a, "q_norm", i),
                      Param(f"{p}.self_attn.k_norm.weight", (a.head_dim,), a, "k_norm", i)]
            qkv = [(f"{p}.self_attn.{n}_proj", size) for n, size in (("q", a.q_size), ("k", a.kv_size),
                                                                       ("v", a.kv_size))]
            specs += _linears([a.qkv_proj] if a.fuse_qkv else [a.q_proj, a.k_proj, a.v_proj], qkv, i)
            specs.append(LinearSpec(a.o_proj, [f"{p}.self_attn.o_proj"], [h], i))
            m = layer.mlp
            if layer.is_moe:
                inter = int(c["moe_intermediate_size"])
                specs.append(Param(f"{p}.mlp.gate.weight", (m.num_experts, h), m, "gate", i))
                projs = [ExpertProj("gate_proj", "w_gate", h, inter), ExpertProj("up_proj", "w_up", h, inter),
                         ExpertProj("down_proj", "w_down", inter, h)]
                fused = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}   # transformers 5
                specs.append(ExpertsSpec(f"{p}.mlp.experts", m, m.num_experts, projs, fused, i))
            else:
                inter = int(c["intermediate_size"])
                gu = [(f"{p}.mlp.gate_proj", inter), (f"{p}.mlp.up_proj", inter)]
                specs += _linears([m.gate_up_proj] if m.fuse else [m.gate_proj, m.up_proj], gu, i)
                specs.append(LinearSpec(m.down_proj, [f"{p}.mlp.down_proj"], [h], i))
        specs.append(LinearSpec(self.lm_head, ["lm_head"], [v], hint=" (and tie_word_embeddings is false)"))
        return specs

    def tie_weights(self) -> None:
        """lm_head = the embedding when the config ties them and the checkpoint has no lm_head."""
        if self.lm_head.weight is None and self.lm_head.gptq is None and self.config.get("tie_word_embeddings"):
            self.lm_head.weight = self.embed_tokens

    def set_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Where the loader puts the weights: the buffers follow."""
        self.dtype = dtype
        self.cos_sin = self.cos_sin.to(device)


def _linears(linears: list[Linear], modules: list[tuple[str, int]], layer: int) -> list[LinearSpec]:
    """One Linear for all ``modules`` (fused) or one each."""
    if len(linears) == 1:
        return [LinearSpec(linears[0], [n for n, _ in modules], [s for _, s in modules], layer)]
    return [LinearSpec(lin, [n], [s], layer) for lin, (n, s) in zip(linears, modules)]


Qwen3MoeForCausalLM = Qwen3ForCausalLM
