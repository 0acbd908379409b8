"""Min-max group quantization (AutoGPTQ's Quantizer), the one round-to-nearest, and a quantized linear's result.

The bit format itself (packing, v1 zeros, dequantization) is ``onecard.kernels.gptq_gemm.format``'s.
Quantization parameters follow AutoGPTQ: the range always holds 0, sym zero = 2^(bits-1) (and a group with no
negative weight keeps xmin = 0, as AutoGPTQ does), a dead group gets the range [-1, 1]; scales are rounded to
fp16 before the codes are chosen, so the fp16 checkpoint dequantizes to exactly what was optimised.
``QuantizedLinear`` holds codes/zeros/scales in the x @ W orientation (rows in input order, not act-order);
``.disk_tensors(fmt)`` gives the four tensors written to a checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onecard.kernels.gptq_gemm import format as gptq_format


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
        return gptq_format.num_groups(in_features, self.group_size)

    def effective_group(self, in_features: int) -> int:
        return gptq_format.effective_group(in_features, self.group_size)


@dataclass(slots=True)
class QuantizedLinear:
    """One quantized linear (W [K, N] = nn.Linear weight transposed)."""

    q: torch.Tensor            # int32 [K, N] codes in [0, maxq]
    scales: torch.Tensor       # fp16 [G, N]
    zeros: torch.Tensor        # int32 [G, N] TRUE zeros
    g_idx: torch.Tensor        # int32 [K]
    group_size: int            # K when asked for -1

    @property
    def qweight(self) -> torch.Tensor:
        return gptq_format.pack_rows(self.q)                                     # int32 [K/8, N]

    @property
    def qzeros(self) -> torch.Tensor:
        return gptq_format.pack_cols(self.zeros)                                 # int32 [G, N/8] true zeros

    @property
    def dequant(self) -> torch.Tensor:
        """float32 [K, N] = (q - z[g]) * s[g], exactly what the packed tensors mean."""
        g = self.g_idx.long()
        return (self.q.long() - self.zeros.long()[g]).float() * self.scales.float()[g]

    def disk_tensors(self, fmt: str = "gptq") -> dict[str, torch.Tensor]:
        """The four on-disk tensors (CPU). v1 ("gptq") stores zeros - 1, v2 ("gptq_v2") true zeros."""
        gptq_format.check_format(fmt)
        qz = self.qzeros
        if fmt == "gptq":
            if bool((self.zeros < 1).any()):
                raise ValueError("a true zero of 0 cannot be stored in the v1 format; use gptq_v2.")
            qz = gptq_format.to_v1(qz)
        return {"qweight": self.qweight.cpu(), "qzeros": qz.cpu(), "scales": self.scales.cpu(),
                "g_idx": self.g_idx.cpu().to(torch.int32)}

    def __iter__(self):
        """``qweight, qzeros, scales, g_idx = quantize_rtn(...)`` (true zeros)."""
        return iter((self.qweight, self.qzeros, self.scales, self.g_idx))


def find_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and true zero for w [R, C] (R = output channels, C = the group's input columns).

    Returns (scale [R], zero [R]) as float32; zero holds integers. Asym zeros are clamped to >= ``min_zero``:
    1 keeps them storable in v1 checkpoints (stored zero - 1) for other readers (AutoGPTQ/vLLM add 1 without
    wrapping mod 16).
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
        zero = torch.clamp(torch.round(-xmin / scale), min_zero, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (as float) for w [R, C] with per-row scale/zero [R]."""
    return torch.clamp(torch.round(w / scale.unsqueeze(1)) + zero.unsqueeze(1), 0, maxq)


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool, desc_act_perm: torch.Tensor | None = None,
                 min_zero: int = 0, bits: int = gptq_format.BITS) -> QuantizedLinear:
    """w [N, K] float (nn.Linear layout) -> round to nearest per group.

    Groups are consecutive input rows in ``desc_act_perm`` order (identity when None); rows stay stored in
    input order, so a permutation gives a shuffled g_idx. ``min_zero`` as in ``find_params``.
    """
    n, k = w.shape
    if k % gptq_format.PACK or n % gptq_format.PACK:
        raise ValueError(f"GPTQ 4-bit needs in/out features divisible by 8, got [{n}, {k}]")
    maxq = (1 << bits) - 1
    gs = gptq_format.effective_group(k, group_size)
    ng = gptq_format.num_groups(k, group_size)
    dev = w.device
    perm = torch.arange(k, device=dev) if desc_act_perm is None else desc_act_perm.to(dev).long()
    g_idx = torch.empty(k, dtype=torch.int32, device=dev)
    g_idx[perm] = (torch.arange(k, device=dev) // gs).to(torch.int32)
    wf = w.detach().float()
    q = torch.empty(n, k, dtype=torch.int32, device=dev)
    scales = torch.empty(ng, n, dtype=torch.float32, device=dev)
    zeros = torch.empty(ng, n, dtype=torch.int32, device=dev)
    for g in range(ng):
        cols = perm[g * gs: (g + 1) * gs]                                 # the group's input rows
        s, z = find_params(wf[:, cols], bits, sym, min_zero)
        q[:, cols] = quantize_codes(wf[:, cols], s, z, maxq).to(torch.int32)
        scales[g], zeros[g] = s, z.to(torch.int32)
    return QuantizedLinear(q.t().contiguous(), scales.half(), zeros, g_idx, gs)
