"""Asymmetric/symmetric min-max group quantizer, round-to-nearest, and packing to the GPTQ on-disk format.

Contract (the GPTQModel/AutoGPTQ layout, see REFERENCE.md "GPTQ on disk"): a linear layer y = x @ W with
W [K, N] (K = in, N = out; nn.Linear stores W^T [N, K]) is written as
  qweight int32 [K/8, N]   nibble k % 8 (shift 4*(k%8)) of row k // 8 holds q[k, n]
  qzeros  int32 [G, N/8]   nibble n % 8 of column n // 8 holds the stored zero (v1: true zero - 1)
  scales  fp16  [G, N]
  g_idx   int32 [K]        the group of input row k (k // G, or the act-order group)
so that W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] with z the TRUE zero.
Quantization parameters follow AutoGPTQ's Quantizer (min/max including 0, sym zero = 2^(bits-1)); scales are
rounded to fp16 before the integers are chosen, so the fp16 checkpoint dequantizes to exactly what was
optimised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128          # -1 = one group over the whole input dimension
    sym: bool = True
    desc_act: bool = False

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int) -> int:
        g = self.effective_group(in_features)
        return (in_features + g - 1) // g

    def effective_group(self, in_features: int) -> int:
        return in_features if self.group_size in (-1, 0) else self.group_size


@dataclass(slots=True)
class QuantResult:
    """One quantized linear in the x @ W orientation (input order of rows, not act-order)."""
    q: torch.Tensor          # int32 [K, N] integer codes in [0, maxq]
    scales: torch.Tensor     # float32 [G, N] (already fp16-representable)
    zeros: torch.Tensor      # int32 [G, N] TRUE zeros
    g_idx: torch.Tensor      # int32 [K]

    def dequantize(self) -> torch.Tensor:
        """float32 [K, N]."""
        g = self.g_idx.long()
        return (self.q.float() - self.zeros[g].float()) * self.scales[g]


def find_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and true zero for w [R, C] (R = output channels, C = the group's input columns).

    Returns (scale [R], zero [R]) as float32; zero holds integers.
    """
    maxq = (1 << bits) - 1
    w = w.float()
    xmin = torch.clamp(w.min(dim=1).values, max=0.0)          # [R] the range always includes 0
    xmax = torch.clamp(w.max(dim=1).values, min=0.0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(flat, torch.full_like(xmax, 1.0), xmax)
    scale = ((xmax - xmin) / maxq).half().float()              # fp16-exact, as stored
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0 ** -24), scale)   # fp16 underflow guard
    if sym:
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        # zero >= 1: v1 checkpoints store zero - 1 and a true zero of 0 has no unambiguous v1 encoding
        zero = torch.clamp(torch.round(-xmin / scale), 1, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (as float) for w [R, C] with per-row scale/zero [R]."""
    return torch.clamp(torch.round(w / scale.unsqueeze(1)) + zero.unsqueeze(1), 0, maxq)


def rtn_quantize(weight: torch.Tensor, spec: QuantSpec) -> QuantResult:
    """Round-to-nearest per group. weight: nn.Linear layout [N, K]."""
    w = weight.float()
    n_out, k_in = w.shape
    g = spec.effective_group(k_in)
    ng = spec.groups(k_in)
    q = torch.empty(n_out, k_in, dtype=torch.int32, device=w.device)
    scales = torch.empty(ng, n_out, dtype=torch.float32, device=w.device)
    zeros = torch.empty(ng, n_out, dtype=torch.int32, device=w.device)
    for gi in range(ng):
        cols = slice(gi * g, min((gi + 1) * g, k_in))
        s, z = find_params(w[:, cols], spec.bits, spec.sym)
        q[:, cols] = quantize_codes(w[:, cols], s, z, spec.maxq).to(torch.int32)
        scales[gi], zeros[gi] = s, z.to(torch.int32)
    g_idx = (torch.arange(k_in, device=w.device) // g).to(torch.int32)
    return QuantResult(q.t().contiguous(), scales, zeros, g_idx)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] 4-bit codes -> int32 [ceil(R/8), C]; row 8r + j goes to nibble j of packed row r."""
    r, c = q.shape
    pad = (-r) % 8
    if pad:
        q = torch.cat([q, q.new_zeros(pad, c)], dim=0)
    q = q.to(torch.int64).view(-1, 8, c)                                   # [R/8, 8, C]
    shifts = (torch.arange(8, device=q.device, dtype=torch.int64) * 4).view(1, 8, 1)
    packed = (q << shifts).sum(dim=1)                                      # [R/8, C] in [0, 2^32)
    return _to_int32(packed)


def pack_cols(z: torch.Tensor) -> torch.Tensor:
    """int [R, C] 4-bit codes -> int32 [R, ceil(C/8)]; column 8c + j goes to nibble j of packed column c."""
    return pack_rows(z.t().contiguous()).t().contiguous()


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    # values are unsigned 32-bit; reinterpret as two's complement int32 like numpy's astype(uint32).view(int32)
    x = torch.where(x >= 2 ** 31, x - 2 ** 32, x)
    return x.to(torch.int32)


def pack_result(res: QuantResult, bits: int = 4, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The four on-disk tensors of one linear. v1 ("gptq") stores zeros - 1, v2 ("gptq_v2") true zeros."""
    if bits != 4:
        raise ValueError(f"--bits {bits}: only 4-bit packing is implemented (onecard's kernels are W4A16).")
    zeros = res.zeros.to(torch.int64)
    if checkpoint_format == "gptq":
        if bool((zeros < 1).any()):
            raise ValueError("a true zero of 0 cannot be stored in the v1 format; use gptq_v2.")
        zeros = zeros - 1
    elif checkpoint_format != "gptq_v2":
        raise ValueError(f"checkpoint_format {checkpoint_format!r}: use 'gptq' (v1) or 'gptq_v2'.")
    return {
        "qweight": pack_rows(res.q.cpu()),
        "qzeros": pack_cols(zeros.cpu()),
        "scales": res.scales.cpu().to(torch.float16),
        "g_idx": res.g_idx.cpu().to(torch.int32),
    }
