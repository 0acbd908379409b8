"""RTN quantization (onecard.quant.quantizer), GPTQ packing (onecard.kernels.gptq_gemm.format) and checkpoint
copies (onecard.quant.pack), checked against the on-disk spec written out here and against the reference
kernel's dequantization."""
from __future__ import annotations

import pytest
import torch

from onecard.kernels.gptq_gemm.format import (
    dequantize,
    from_v1,
    pack_cols,
    pack_rows,
    to_v1,
    trivial_g_idx,
    unpack_cols,
    unpack_rows,
)
from onecard.kernels.gptq_gemm.ref import dequantize_gptq
from onecard.kernels.types import GPTQWeight
from onecard.quant.pack import dynamic_override, gptq_copy, is_quantizable, read_safetensors_dir
from onecard.quant.quantizer import quantize_rtn


def _nibble(word: int, j: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * j)) & 0xF


def test_pack_rows_and_cols_bit_layout():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 8), generator=gen)
    q[7, 0] = 15                                                             # top nibble set: negative int32
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (2, 8) and (packed < 0).any()
    for k in range(16):
        for n in range(8):
            assert _nibble(int(packed[k // 8, n]), k % 8) == int(q[k, n])
    z = torch.randint(0, 16, (3, 16), generator=gen)
    pz = pack_cols(z)
    assert pz.shape == (3, 2)
    for g in range(3):
        for n in range(16):
            assert _nibble(int(pz[g, n // 8]), n % 8) == int(z[g, n])
    assert torch.equal(unpack_rows(packed), q.to(torch.int32))
    assert torch.equal(unpack_cols(pz), z.to(torch.int32))


def test_v1_zero_conversion_round_trips():
    z = torch.arange(16).repeat(2, 1)                                        # includes zero 0 (wraps to 15)
    true = pack_cols(z)
    v1 = to_v1(true)
    assert torch.equal(unpack_cols(v1), ((z - 1) % 16).to(torch.int32))
    assert torch.equal(from_v1(v1), true)
    assert (to_v1(pack_cols(torch.full((1, 8), 8))) == 0x77777777).all()  # sym v1: the famous constant


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_quantize_rtn(sym, group_size, act_order):
    n, k = 48, 256
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen) * 0.1
    w[:, 5] = 0.7                                                            # an outlier row
    perm = torch.randperm(k, generator=gen) if act_order else None
    ql = quantize_rtn(w, group_size, sym, perm)
    gs = k if group_size == -1 else group_size
    groups = k // gs
    assert ql.qweight.shape == (k // 8, n) and ql.qweight.dtype == torch.int32
    assert ql.qzeros.shape == (groups, n // 8) and ql.scales.shape == (groups, n)
    assert ql.scales.dtype == torch.float16 and ql.g_idx.shape == (k,) and ql.group_size == gs
    order = perm if perm is not None else torch.arange(k)
    assert torch.equal(ql.g_idx[order].long(), torch.arange(k) // gs)       # groups over act-order rows
    assert int(ql.q.min()) >= 0 and int(ql.q.max()) <= 15
    if sym:
        assert (ql.zeros == 8).all()
    # Dequantization from the packed tensors, by the spec written out here.
    q = unpack_rows(ql.qweight).long()
    z = unpack_cols(ql.qzeros).long()
    g = ql.g_idx.long()
    dq = (q - z[g]).float() * ql.scales.float()[g]                          # [K, N]
    assert torch.equal(dq, ql.dequant)
    assert torch.equal(q, ql.q.long())
    # And by the reference kernel.
    gw = GPTQWeight(ql.qweight, ql.qzeros, ql.scales, ql.g_idx, gs, k, n)
    assert torch.equal(dequantize_gptq(gw), ql.dequant)
    # RTN error bound: half a step (sym may clip the positive end by half a step too), a step for asym;
    # plus the fp16 rounding of the scale (relative 2^-11) times the largest code offset (<= 16).
    err = (ql.dequant - w.t()).abs()
    step = ql.scales.float()[g]
    assert (err <= step * ((0.5 if sym else 1.0) + 16 * 2**-11) + 1e-6).all()
    assert err.mean() < 0.3 * step.mean()


def test_dead_group_and_bad_shapes():
    w = torch.zeros(8, 32)
    ql = quantize_rtn(w, 32, sym=False)
    assert torch.equal(ql.dequant, torch.zeros(32, 8))
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_rows(torch.zeros(12, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_cols(torch.zeros(1, 12, dtype=torch.int64))


def _spec_dequant_from_disk(qweight, qzeros, scales, g_idx, v1: bool) -> torch.Tensor:
    """Independent reading of the documented disk layout, one nibble at a time (float64)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    qw = qweight.to(torch.int64) & 0xFFFFFFFF
    qz = qzeros.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(qw[kk // 8] >> (4 * (kk % 8))) & 0xF for kk in range(k)])             # [K, N]
    z = torch.stack([(qz[:, nn // 8] >> (4 * (nn % 8))) & 0xF for nn in range(n)], dim=1)  # [G, N]
    if v1:
        z = z + 1                                       # as AutoGPTQ reads v1: +1 without wrapping
    g = g_idx.long()
    return ((q - z[g]).double() * scales.double()[g]).float()


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_disk_tensors_every_variant(fmt, sym, group_size, act_order):
    n, k = 40, 256
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=gen) * 0.05 + (0.02 if not sym else 0.0)   # asym: skewed ranges
    perm = torch.randperm(k, generator=gen) if act_order else None
    ql = quantize_rtn(w, group_size, sym, perm, min_zero=1 if fmt == "gptq" else 0)
    disk = ql.disk_tensors(fmt)
    assert disk["qweight"].dtype == torch.int32 and disk["qzeros"].dtype == torch.int32
    assert disk["scales"].dtype == torch.float16 and disk["g_idx"].dtype == torch.int32
    if act_order and group_size != -1:                                           # one group: nothing to shuffle
        assert not torch.equal(disk["g_idx"], torch.sort(disk["g_idx"]).values)   # really shuffled
    if fmt == "gptq" and sym:
        assert (disk["qzeros"] == 0x77777777).all()
    if fmt == "gptq":
        assert int(ql.zeros.min()) >= 1                                          # v1-safe zeros
    ref = _spec_dequant_from_disk(disk["qweight"], disk["qzeros"], disk["scales"], disk["g_idx"], fmt == "gptq")
    assert torch.equal(ref, ql.dequant)
    assert torch.equal(dequantize(**disk, fmt=fmt), ql.dequant)
    if not act_order:                                                            # trivial g_idx may be dropped
        gs = k if group_size == -1 else group_size
        assert torch.equal(disk["g_idx"], trivial_g_idx(k, group_size))
        assert torch.equal(dequantize(disk["qweight"], disk["qzeros"], disk["scales"], None, fmt, gs), ql.dequant)
    # The tuple form is the true-zero packed tensors.
    _qweight, qzeros, _scales, _g_idx = ql
    assert torch.equal(qzeros, ql.qzeros) and torch.equal(from_v1(to_v1(qzeros)), qzeros)


def test_quantize_rtn_rejects_odd_shapes():
    with pytest.raises(ValueError, match="divisible by 8"):
        quantize_rtn(torch.zeros(12, 32), 32, sym=True)
    with pytest.raises(ValueError, match="divisible by 8"):
        quantize_rtn(torch.zeros(8, 36), 32, sym=True)


def test_dynamic_override_rules():
    dyn = {r"-:model\.layers\.0\.self_attn\..*": {},
           r"+:.*\.mlp\.experts\.[0-3]\..*": {"group_size": 64, "sym": False},
           r".*down_proj": {"desc_act": True}}
    assert dynamic_override(dyn, "model.layers.0.self_attn.q_proj") is None          # "-:" exclusion
    assert dynamic_override(dyn, "model.layers.1.self_attn.q_proj") == {}            # no rule matches
    assert dynamic_override(dyn, "model.layers.1.mlp.experts.2.up_proj") == {"group_size": 64, "sym": False}
    assert dynamic_override(dyn, "model.layers.1.mlp.experts.2.down_proj") == {"group_size": 64, "sym": False}
    assert dynamic_override(dyn, "model.layers.1.mlp.experts.5.down_proj") == {"desc_act": True}
    assert dynamic_override(None, "lm_head") == {}
    assert is_quantizable("model.layers.3.mlp.experts.17.gate_proj")
    assert is_quantizable("model.layers.3.self_attn.o_proj") and is_quantizable("model.layers.3.mlp.up_proj")
    assert not is_quantizable("model.layers.3.mlp.gate") and not is_quantizable("lm_head")


def test_gptq_copy_honours_dynamic(tiny_moe_dir, tmp_path):
    import json

    from safetensors import safe_open

    dyn = {r"-:model\.layers\.1\.self_attn\.(q|k|v)_proj": {},
           r"+:model\.layers\.0\.mlp\.experts\..*\.down_proj": {"group_size": 16, "sym": False}}
    record: dict = {}
    out = gptq_copy(tiny_moe_dir, tmp_path / "q", group_size=32, sym=True, fmt="gptq_v2", dynamic=dyn,
                    record=record)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["dynamic"] == dyn
    assert cfg["quantization_config"]["checkpoint_format"] == "gptq_v2"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        src = safe_open(str(tiny_moe_dir / "model.safetensors"), "pt")
        # excluded modules stay float (fp16 copies of the source)
        for p in ("q", "k", "v"):
            name = f"model.layers.1.self_attn.{p}_proj"
            assert f"{name}.weight" in keys and f"{name}.qweight" not in keys and name not in record
            assert torch.equal(f.get_tensor(f"{name}.weight"), src.get_tensor(f"{name}.weight").half())
        assert "model.layers.1.self_attn.o_proj.qweight" in keys
        # the override's group size and asymmetry reach the tensors
        d0 = "model.layers.0.mlp.experts.4.down_proj"
        assert f.get_tensor(f"{d0}.scales").shape == (32 // 16, 64) and record[d0].group_size == 16
        assert not (record[d0].zeros == 8).all()
        assert f.get_tensor("model.layers.1.mlp.experts.4.down_proj.scales").shape == (1, 64)
        # what was written dequantizes to what was recorded, and approximates the float weight
        for module, ql in record.items():
            disk = {p: f.get_tensor(f"{module}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx")}
            assert torch.equal(dequantize(**disk, fmt="gptq_v2"), ql.dequant), module
        wq = src.get_tensor(f"{d0}.weight")
        assert (record[d0].dequant.t() - wq).abs().max() <= record[d0].scales.float().max()
        # router, norms, embeddings and lm_head are never quantized
        for name in ("model.layers.0.mlp.gate.weight", "model.norm.weight", "model.embed_tokens.weight",
                     "lm_head.weight", "model.layers.0.self_attn.q_norm.weight"):
            assert name in keys and name.replace(".weight", ".qweight") not in keys


def test_gptq_copy_sharded_matches_single(tiny_moe_dir, tmp_path):
    one = gptq_copy(tiny_moe_dir, tmp_path / "one", group_size=32, sym=False, fmt="gptq", desc_act=True)
    many = gptq_copy(tiny_moe_dir, tmp_path / "many", group_size=32, sym=False, fmt="gptq", desc_act=True,
                     num_shards=3)
    assert len(list(many.glob("model-*-of-00003.safetensors"))) == 3
    a, b = read_safetensors_dir(one), read_safetensors_dir(many)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
