"""The loader's GPTQWeights decode to exactly what the packer quantized, for every checkpoint variant
(sym/asym x v1/v2 x group 32/128/-1, act-order shuffled g_idx, dynamic overrides and exclusions), and an
unpacker written independently in tests/model/common.py agrees with the files on disk."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from onecard.kernels.gptq_gemm.ref import dequantize_gptq
from onecard.quant.pack import gptq_copy
from tests.model.common import dequantize_module, load_ours

VARIANTS = [(sym, fmt, gs, False) for sym in (True, False) for fmt in ("gptq", "gptq_v2") for gs in (32, 128, -1)]
VARIANTS += [(True, "gptq", 32, True), (False, "gptq_v2", 32, True), (False, "gptq", 16, True)]


def loaded_dequant(model) -> dict[str, torch.Tensor]:
    """module name -> float32 W [K, N] decoded from the loaded model's GPTQWeights (float modules skipped)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        a, p = layer.self_attn, f"model.layers.{i}.self_attn"
        if a.fuse_qkv:
            if a.qkv_proj.gptq is not None:
                w = dequantize_gptq(a.qkv_proj.gptq)
                for name, part in zip(("q", "k", "v"), w.split([a.q_size, a.kv_size, a.kv_size], dim=1)):
                    out[f"{p}.{name}_proj"] = part
        else:
            for name in ("q", "k", "v"):
                lin = getattr(a, f"{name}_proj")
                if lin.gptq is not None:
                    out[f"{p}.{name}_proj"] = dequantize_gptq(lin.gptq)
        if a.o_proj.gptq is not None:
            out[f"{p}.o_proj"] = dequantize_gptq(a.o_proj.gptq)
        if layer.is_moe:
            for proj in ("gate", "up", "down"):
                w = getattr(layer.mlp, f"w_{proj}")
                if not isinstance(w, torch.Tensor):
                    for e, we in enumerate(dequantize_gptq(w)):
                        out[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj"] = we
    return out


@pytest.mark.parametrize("slice_copies", [False, True], ids=["stacked", "slice_copies"])
@pytest.mark.parametrize("sym,fmt,group_size,desc_act", VARIANTS)
def test_loaded_weights_equal_packer(tiny_moe_dir, tmp_path, monkeypatch, sym, fmt, group_size, desc_act,
                                     slice_copies):
    # slice_copies: every expert part is copied into its slice of the stacked tensor one by one (the path the
    # full-size model's big parts take; the tiny ones are under the size threshold otherwise)
    if slice_copies:
        monkeypatch.setattr("onecard.models.loader._DIRECT_COPY_MIN_BYTES", 0)
    record: dict = {}
    dst = gptq_copy(tiny_moe_dir, tmp_path / "q", group_size=group_size, sym=sym, fmt=fmt, desc_act=desc_act,
                    seed=7, record=record)
    assert len(record) == 2 * (4 + 8 * 3)
    model = load_ours(dst)
    got = loaded_dequant(model)
    assert set(got) == set(record)
    for name, ql in record.items():
        assert torch.equal(got[name], ql.dequant), name
    if desc_act:
        assert any(not torch.equal(ql.g_idx.long(), torch.sort(ql.g_idx.long()).values) for ql in record.values())
    # The files on disk, read by an unpacker written from the spec alone.
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.experts.6.down_proj"):
            w = dequantize_module(f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.qzeros"),
                                  f.get_tensor(f"{name}.scales"), f.get_tensor(f"{name}.g_idx"), v1=fmt == "gptq")
            assert torch.equal(w.t(), record[name].dequant), name


def test_dynamic_exclusion_and_override(tiny_moe_dir, tmp_path):
    dynamic = {r"-:.*layers\.1\.self_attn\.o_proj": {}, r"+:.*layers\.0\..*": {"group_size": 16}}
    record: dict = {}
    dst = gptq_copy(tiny_moe_dir, tmp_path / "q", group_size=32, dynamic=dynamic, record=record)
    model = load_ours(dst)
    assert "model.layers.1.self_attn.o_proj" not in record
    o = model.layers[1].self_attn.o_proj
    assert o.gptq is None and o.weight is not None
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        ref = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
    assert torch.equal(o.weight, ref.half().float())                         # kept float (fp16 on disk)
    assert record["model.layers.0.self_attn.q_proj"].scales.shape[0] == 64 // 16
    assert record["model.layers.1.self_attn.q_proj"].scales.shape[0] == 64 // 32
    got = loaded_dequant(model)
    for name, ql in record.items():
        assert torch.equal(got[name], ql.dequant), name
