"""The GPTQ 4-bit format: the one place that packs, unpacks and dequantizes it (kernels, loader, quantizer and
tests all import this module).

Layout (GPTQModel/AutoGPTQ, REFERENCE.md "GPTQ on disk"); a linear y = x @ W with W [K, N] (K = in, N = out;
nn.Linear stores W^T [N, K]), G groups; a leading expert dimension E is allowed on every tensor:
  qweight int32 [(E,) K/8, N]  nibble k % 8 (shift 4*(k % 8)) of row k // 8 holds the code q[k, n]
  qzeros  int32 [(E,) G, N/8]  nibble n % 8 of column n // 8 holds the zero of output n:
                               "gptq" (v1) stores true zero - 1 (mod 16), "gptq_v2" the true zero
  scales  fp16  [(E,) G, N]
  g_idx   int32 [(E,) K]       group of input row k: k // group_size ("trivial"), or act-order's group
  W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] with z the TRUE zero.
Inside onecard (``GPTQWeight``) zeros are always true zeros and a trivial g_idx is None. Packed words hold
unsigned 32-bit patterns in int32 (two's complement), like numpy's ``astype(uint32).view(int32)``.
"""
from __future__ import annotations

import torch

from onecard.kernels.types import GPTQWeight

BITS = 4
MAXQ = (1 << BITS) - 1                                   # largest code
PACK = 32 // BITS                                        # codes per int32 word
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")    # a module's tensors on disk (g_idx optional)
FORMATS = ("gptq", "gptq_v2")                            # checkpoint_format: v1 / v2 zeros
_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int64)   # [8] nibble j sits at bit 4j


# ---------------------------------------------------------------- words
def to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _check_divisible(size: int) -> None:
    if size % PACK:
        raise ValueError(f"packing needs a size divisible by {PACK}, got {size}")


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int codes [..., R, C] in [0, 15] -> int32 [..., R/8, C]; row 8r + j goes to nibble j of packed row r."""
    r, c = q.shape[-2], q.shape[-1]
    _check_divisible(r)
    v = q.to(torch.int64).reshape(*q.shape[:-2], r // PACK, PACK, c)            # [..., R/8, 8, C]
    return to_int32((v << _SHIFTS.to(q.device).view(PACK, 1)).sum(dim=-2))


def pack_cols(z: torch.Tensor) -> torch.Tensor:
    """int codes [..., R, C] in [0, 15] -> int32 [..., R, C/8]; column 8c + j goes to nibble j of column c."""
    c = z.shape[-1]
    _check_divisible(c)
    v = z.to(torch.int64).reshape(*z.shape[:-1], c // PACK, PACK)               # [..., R, C/8, 8]
    return to_int32((v << _SHIFTS.to(z.device)).sum(dim=-1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, C] packed along rows -> int32 [..., 8R, C] codes (row 8r + j = nibble j)."""
    shifts = _SHIFTS.to(device=packed.device, dtype=torch.int32)
    nib = (packed.unsqueeze(-2) >> shifts.view(PACK, 1)) & 0xF                  # [..., R, 8, C]
    return nib.reshape(*packed.shape[:-2], packed.shape[-2] * PACK, packed.shape[-1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, C] packed along columns -> int32 [..., R, 8C] codes (column 8c + j = nibble j)."""
    shifts = _SHIFTS.to(device=packed.device, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF                                # [..., R, C, 8]
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


# ---------------------------------------------------------------- zero conventions
def to_v1(qzeros: torch.Tensor) -> torch.Tensor:
    """Packed TRUE zeros -> v1 ("gptq": every nibble minus one, mod 16)."""
    return pack_cols((unpack_cols(qzeros) - 1) & 0xF)


def from_v1(qzeros: torch.Tensor) -> torch.Tensor:
    """Packed v1 zeros -> TRUE zeros (every nibble plus one, mod 16)."""
    return pack_cols((unpack_cols(qzeros) + 1) & 0xF)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format {fmt!r}: use 'gptq' (v1) or 'gptq_v2'.")


# ---------------------------------------------------------------- groups
def effective_group(in_features: int, group_size: int) -> int:
    """The group size in rows: ``in_features`` when the checkpoint says -1 (or 0)."""
    return in_features if group_size in (-1, 0) else group_size


def num_groups(in_features: int, group_size: int) -> int:
    g = effective_group(in_features, group_size)
    return (in_features + g - 1) // g


def trivial_g_idx(in_features: int, group_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [K]: k // group_size."""
    return (torch.arange(in_features, device=device) // effective_group(in_features, group_size)).to(torch.int32)


def is_trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Is g_idx [(E,) K] k // group_size for every row (so the kernels may drop it)?"""
    k = g_idx.shape[-1]
    return torch.equal(g_idx.to(torch.int64), trivial_g_idx(k, group_size, g_idx.device).long().expand_as(g_idx))


def group_index(w: GPTQWeight) -> torch.Tensor:
    """int64 [(E,) K]: the quantization group of every input row."""
    if w.g_idx is not None:
        return w.g_idx.long()
    g = trivial_g_idx(w.in_features, w.group_size, w.qweight.device).long()
    if w.qweight.dim() == 3:
        g = g.expand(w.qweight.shape[0], -1)
    return g


# ---------------------------------------------------------------- disk <-> GPTQWeight, dequantization
def from_disk(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              fmt: str, in_features: int | None = None) -> GPTQWeight:
    """A module's on-disk tensors -> GPTQWeight (true zeros, trivial g_idx dropped; the group size follows from
    the scales' rows). Tensors stay where they are; ``in_features`` defaults to 8 x qweight's rows."""
    check_format(fmt)
    k = in_features if in_features is not None else qweight.shape[-2] * PACK
    group_size = -(-k // scales.shape[-2])
    if g_idx is not None and is_trivial_g_idx(g_idx, group_size):
        g_idx = None
    return GPTQWeight(qweight=qweight, qzeros=from_v1(qzeros) if fmt == "gptq" else qzeros, scales=scales,
                      g_idx=None if g_idx is None else g_idx.to(torch.int32), group_size=group_size,
                      in_features=k, out_features=int(qweight.shape[-1]))


def dequantize_gptq(w: GPTQWeight) -> torch.Tensor:
    """float32 [(E,) K, N] dense weights such that y = x @ W."""
    q = unpack_rows(w.qweight)[..., : w.in_features, :].float()           # [(E,) K, N]
    z = unpack_cols(w.qzeros)[..., : w.out_features].float()              # [(E,) G, N]
    s = w.scales.float()                                                  # [(E,) G, N]
    g = group_index(w)                                                    # [(E,) K]
    idx = g.unsqueeze(-1).expand(*g.shape, w.out_features)                # [(E,) K, N]
    return (q - torch.gather(z, -2, idx)) * torch.gather(s, -2, idx)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               fmt: str = "gptq_v2", group_size: int = -1) -> torch.Tensor:
    """On-disk tensors -> float32 W [K, N] (y = x @ W); ``fmt="gptq"`` reads v1 zeros. Without g_idx the
    groups are k // group_size (-1: one group)."""
    w = from_disk(qweight, qzeros, scales, None, fmt)
    w.group_size = effective_group(w.in_features, group_size)
    if g_idx is not None:
        w.g_idx = g_idx.to(torch.int32)
    return dequantize_gptq(w)


def expert_slice(w: GPTQWeight, e: int) -> GPTQWeight:
    """The 2-D GPTQWeight of expert ``e`` from a stacked one."""
    return GPTQWeight(w.qweight[e], w.qzeros[e], w.scales[e], None if w.g_idx is None else w.g_idx[e],
                      w.group_size, w.in_features, w.out_features)
