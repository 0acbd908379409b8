"""Plain-PyTorch float forward of Qwen3 / Qwen3-MoE decoder layers from a flat HF state dict, with hooks
for calibration (the quantizer's view of the model; independent of onecard's serving model code).

Contract:
  ``ArchInfo.from_config(cfg_dict)`` reads the fields that matter (handles both ``rope_theta`` and
  ``rope_parameters``, ``num_experts``/``num_local_experts``).
  ``rotary(arch, seq_len, device) -> (cos, sin)`` [L, D].
  ``attention_parts(arch, w, prefix, x, cos, sin, proj)`` and ``moe_parts(...)`` compute a layer's pieces;
  ``proj(name, x)`` is the callback that applies linear ``name`` (so the caller can record inputs and swap
  in quantized weights). Weights in ``w`` are the nn.Linear layout [out, in]. Batches are [B, L, H] with
  causal attention and no padding.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Proj = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class ArchInfo:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: list[bool]
    tie_word_embeddings: bool

    @staticmethod
    def from_config(cfg: dict) -> "ArchInfo":
        rope = cfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported by the quantizer's calibration forward.")
        n_layers = int(cfg["num_hidden_layers"])
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers", []) or [])
        moe = [num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(n_layers)]
        heads = int(cfg["num_attention_heads"])
        return ArchInfo(
            num_layers=n_layers, hidden=int(cfg["hidden_size"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, num_experts=num_experts,
            top_k=int(cfg.get("num_experts_per_tok", 0) or 0), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=moe, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def rotary(arch: ArchInfo, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)                                      # [L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)                               # [L, D]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def attention_parts(arch: ArchInfo, w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, proj: Proj, stage: str) -> torch.Tensor:
    """x: normed hidden [B, L, H]. stage 'qkv' stops after q/k/v (returns x), 'all' returns o_proj's output."""
    b, l, _ = x.shape
    d = arch.head_dim
    q = proj(prefix + "q_proj", x).view(b, l, arch.num_heads, d)
    k = proj(prefix + "k_proj", x).view(b, l, arch.num_kv_heads, d)
    v = proj(prefix + "v_proj", x).view(b, l, arch.num_kv_heads, d)
    if stage == "qkv":
        return x
    q = rms_norm(q, w[prefix + "q_norm.weight"], arch.eps).transpose(1, 2)    # [B, nh, L, D]
    k = rms_norm(k, w[prefix + "k_norm.weight"], arch.eps).transpose(1, 2)    # [B, nkv, L, D]
    v = v.float().transpose(1, 2)
    c, s = cos[:l], sin[:l]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    rep = arch.num_heads // arch.num_kv_heads
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)   # [B, nh, L, D]
    ctx = ctx.transpose(1, 2).reshape(b, l, arch.num_heads * d)
    return proj(prefix + "o_proj", ctx)


def route(arch: ArchInfo, gate_w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (top-k weights [T, k], expert ids [T, k]); float router as in HF Qwen3-MoE."""
    probs = torch.softmax(x.float() @ gate_w.float().t(), dim=-1)         # [T, E]
    topw, topi = torch.topk(probs, arch.top_k, dim=-1)
    if arch.norm_topk_prob:
        topw = topw / topw.sum(dim=-1, keepdim=True)
    return topw, topi


def dense_mlp(prefix: str, x: torch.Tensor, proj: Proj, stage: str) -> torch.Tensor | None:
    """SwiGLU MLP; stage 'gate_up' only feeds gate/up (returns None)."""
    g = proj(prefix + "gate_proj", x)
    u = proj(prefix + "up_proj", x)
    if stage == "gate_up":
        return None
    return proj(prefix + "down_proj", F.silu(g) * u)


def moe_parts(arch: ArchInfo, w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, proj: Proj,
              stage: str) -> torch.Tensor | None:
    """x: normed hidden [B, L, H]. Runs each expert on the tokens routed to it (so proj sees exactly those)."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])                                         # [T, H]
    topw, topi = route(arch, w[prefix + "gate.weight"], xt)
    out = torch.zeros(xt.shape[0], shape[-1], dtype=torch.float32, device=x.device)
    for e in range(arch.num_experts):
        tok, slot = torch.nonzero(topi == e, as_tuple=True)               # [n_e]
        ep = f"{prefix}experts.{e}."
        y = dense_mlp(ep, xt[tok], proj, stage)
        if y is not None:
            out.index_add_(0, tok, y.float() * topw[tok, slot].unsqueeze(1))
    return None if stage == "gate_up" else out.view(shape)
