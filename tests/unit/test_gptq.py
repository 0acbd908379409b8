"""GPTQ quantizer: the algorithm beats round-to-nearest on calibration data, the packed tensors round-trip
through the documented unpacking, the calibration forward matches HF transformers, and `onecard quantize`
writes a checkpoint that dequantizes close to the float model and that onecard's loader reads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onecard.kernels.gptq_gemm.format import dequantize
from onecard.quant.checkpoint import dequantize_checkpoint
from onecard.quant.cli import main
from onecard.quant.gptq import HessianAccumulator, gptq_quantize
from onecard.quant.quantizer import QuantSpec, quantize_rtn

transformers = pytest.importorskip("transformers")


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, k // 8, generator=g)
    mix = torch.randn(k // 8, k, generator=g)
    scale = torch.rand(k, generator=g) * 3 + 0.1       # uneven channel magnitudes, like real activations
    return (z @ mix + 0.3 * torch.randn(t, k, generator=g)) * scale   # [T, K]


def _output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float(torch.linalg.norm(x @ wq - x @ w.t()))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("block_size", [128, 32])
def test_gptq_beats_rtn_on_calibration_data(sym: bool, desc_act: bool, block_size: int) -> None:
    k, n = 256, 48
    x = _correlated_inputs(1024, k, seed=1)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05      # nn.Linear [N, K]
    acc = HessianAccumulator(k)
    for chunk in x.split(300):                                                  # uneven chunks: running mean
        acc.add(chunk)
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    spec = QuantSpec(bits=4, group_size=64, sym=sym, desc_act=desc_act)
    gq = gptq_quantize(w, acc.H, spec, damp=0.01, block_size=block_size)
    rq = quantize_rtn(w, spec.group_size, spec.sym, min_zero=1)
    e_gptq = _output_error(x, w, gq.dequant)
    e_rtn = _output_error(x, w, rq.dequant)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)
    assert int(gq.q.min()) >= 0 and int(gq.q.max()) <= 15
    if desc_act:
        # act-order: groups follow decreasing diag(H), so g_idx is not k // G
        assert not torch.equal(gq.g_idx.long(), torch.arange(k) // 64)
        assert sorted(torch.bincount(gq.g_idx.long()).tolist()) == [64] * 4


def test_gptq_without_information_is_rtn() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    spec = QuantSpec(group_size=32, sym=False)
    r = quantize_rtn(w, spec.group_size, spec.sym, min_zero=1)
    for H in (torch.zeros(64, 64), torch.eye(64)):        # no tokens; uncorrelated unit inputs
        g = gptq_quantize(w, H, spec)
        assert torch.equal(g.q, r.q) and torch.equal(g.zeros, r.zeros)
        torch.testing.assert_close(g.scales, r.scales)


@pytest.mark.parametrize("sym,desc_act,fmt", [(True, False, "gptq"), (False, True, "gptq"),
                                              (False, False, "gptq_v2")])
def test_packed_tensors_round_trip(sym: bool, desc_act: bool, fmt: str) -> None:
    k, n = 128, 24
    x = _correlated_inputs(256, k, seed=4)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    acc = HessianAccumulator(k)
    acc.add(x)
    res = gptq_quantize(w, acc.H, QuantSpec(group_size=32, sym=sym, desc_act=desc_act))
    t = res.disk_tensors(fmt)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (k // 8, n)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (k // 32, n // 8)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (k // 32, n)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].shape == (k,)
    # the REFERENCE.md formula, written out independently of any packer
    qw = t["qweight"]
    q = torch.stack([(qw[kk // 8] >> (4 * (kk % 8))) & 0xF for kk in range(k)])          # [K, N]
    assert torch.equal(q, res.q)
    zs = torch.stack([(t["qzeros"][:, nn // 8] >> (4 * (nn % 8))) & 0xF for nn in range(n)], dim=1)
    true_z = zs + 1 if fmt == "gptq" else zs
    assert torch.equal(true_z, res.zeros)
    if sym and fmt == "gptq":
        assert bool((t["qzeros"] == 0x77777777).all())
    expected = res.dequant                                                              # [K, N]
    got = dequantize(qw, t["qzeros"], t["scales"], t["g_idx"], fmt, 32)                  # [K, N]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # and the kernel contract's reference dequantizer (true zeros, onecard.kernels.types)
    ref = pytest.importorskip("onecard.kernels.gptq_gemm.ref")
    from onecard.kernels.gptq_gemm.format import pack_cols
    from onecard.kernels.types import GPTQWeight
    gw = GPTQWeight(qw, pack_cols(res.zeros), t["scales"], t["g_idx"], 32, k, n)
    torch.testing.assert_close(ref.dequantize_gptq(gw), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- model level

def _tiny_moe(path: Path, seed: int = 0) -> Path:
    """A random Qwen3-MoE with a tiny BPE tokenizer (HF's own classes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    text = Path(__file__).read_text()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0,
                         max_position_embeddings=256)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():   # larger weights than the 0.02 init, so that quantization error is visible
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "calib.txt").write_text(text)
    return path


@pytest.fixture(scope="module")
def own_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_moe(tmp_path_factory.mktemp("own_moe"))


def _hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def test_calibration_forward_matches_hf(own_moe: Path) -> None:
    """The quantizer's calibration forward (onecard's model, layer by layer, on the reference kernels)."""
    from transformers import Qwen3MoeForCausalLM

    from onecard.kernels import dispatch
    from onecard.models.qwen3 import Qwen3MoeForCausalLM as Ours
    from onecard.quant.calibrate import CalibrationLayer, layer_specs, prefill_metadata
    from onecard.quant.checkpoint import FloatCheckpoint

    ckpt = FloatCheckpoint(own_moe)
    ids = torch.randint(0, ckpt.config["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(0))
    model = Qwen3MoeForCausalLM.from_pretrained(str(own_moe), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states

    cpu = torch.device("cpu")
    ours = Ours(ckpt.config, ids.shape[1])
    ours.set_device(cpu, torch.float32)
    specs = layer_specs(ours)
    md = prefill_metadata(2, ids.shape[1], cpu)
    pos = torch.arange(ids.shape[1]).repeat(2)
    kv_shape = (2, ids.shape[1], ours.num_kv_heads, ours.head_dim)
    kv = (torch.zeros(kv_shape), torch.zeros(kv_shape))
    h = ckpt.get("model.embed_tokens.weight")[ids.reshape(-1)]                  # [2*20, H]
    with dispatch.use_backend("ref"):
        for i in range(ours.num_layers):
            h = CalibrationLayer(ours, specs[i], ckpt, cpu).forward(h, pos, kv, md)
            if i + 1 < ours.num_layers:    # HF's last hidden state is after the final norm
                torch.testing.assert_close(h.view(2, ids.shape[1], -1), ref[i + 1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("desc_act", [False, True])
def test_quantize_end_to_end_beats_rtn(own_moe: Path, tmp_path: Path, desc_act: bool) -> None:
    common = ["--group-size", "32", "--calibration", str(own_moe / "calib.txt"), "--num-samples", "16",
              "--seq-len", "64", "--device", "cpu"] + (["--desc-act"] if desc_act else [])
    assert main([str(own_moe), str(tmp_path / "gptq")] + common) == 0
    assert main([str(own_moe), str(tmp_path / "rtn"), "--rtn"] + common) == 0

    out = tmp_path / "gptq"
    cfg = json.loads((out / "config.json").read_text())
    qcfg = json.loads((out / "quantize_config.json").read_text())
    assert cfg["quantization_config"] == qcfg
    assert {k: qcfg[k] for k in ("bits", "group_size", "desc_act", "sym", "checkpoint_format", "lm_head",
                                 "quant_method", "pack_dtype")} == {
        "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": True, "checkpoint_format": "gptq",
        "lm_head": False, "quant_method": "gptq", "pack_dtype": "int32"}
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float16
        assert f.get_tensor("model.layers.1.mlp.experts.3.down_proj.qweight").shape == (32 // 8, 64)
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.0.self_attn.q_proj.qweight" in keys and "model.layers.0.self_attn.q_proj.weight" not in keys

    # GPTQ's logits on calibration-like text stay closer to the float model's than RTN's
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(own_moe))
    ids = torch.tensor([tok((own_moe / "calib.txt").read_text())["input_ids"][:128]])
    ref = _hf_logits(own_moe, ids)
    err = {}
    for name in ("gptq", "rtn"):
        deq = dequantize_checkpoint(tmp_path / name, tmp_path / (name + "_float"))
        err[name] = float(torch.linalg.norm(_hf_logits(deq, ids) - ref))
    assert err["gptq"] < 0.9 * err["rtn"], err


@pytest.mark.parametrize("fixture,desc_act", [("tiny_moe_dir", False), ("tiny_moe_dir", True),
                                              ("tiny_dense_dir", False)])
def test_fixture_checkpoint_runs_in_onecard(request: pytest.FixtureRequest, tmp_path: Path, fixture: str,
                                            desc_act: bool) -> None:
    """Quantize a shared fixture (MoE, dense); onecard's loader and model give HF's logits on the same weights."""
    src = Path(request.getfixturevalue(fixture))
    calib = tmp_path / "calib.txt"
    calib.write_text(Path(__file__).read_text())
    out = tmp_path / "q"
    assert main([str(src), str(out), "--group-size", "32", "--calibration", str(calib),
                 "--num-samples", "8", "--seq-len", "32", "--device", "cpu"]
                + (["--desc-act"] if desc_act else [])) == 0
    try:
        from tests.model.common import hf_logits, load_hf, load_ours, prompts
        from tests.model.paged import PagedCache
    except ImportError as e:
        pytest.skip(f"onecard's model test helpers are not available yet ({e})")
    ours = load_ours(out)
    hf = load_hf(dequantize_checkpoint(out, tmp_path / "deq"))
    seq = prompts(int(json.loads((out / "config.json").read_text())["vocab_size"]), [19], seed=3)[0]
    cache = PagedCache.for_model(ours, num_blocks=16, block_size=4)
    (h,) = cache.step(ours, [(cache.new_seq(), seq)])
    torch.testing.assert_close(ours.compute_logits(h), hf_logits(hf, seq), rtol=1e-3, atol=1e-4)
