"""Loader: sharded and fused-expert checkpoints load identically to the single-file per-expert one, and each
kind of bad checkpoint fails with a ConfigError that names the problem."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from onecard.config import ConfigError, EngineArgs, Env
from onecard.quant.pack import read_safetensors_dir, save_safetensors
from tests.model.common import load_ours, prompts
from tests.model.paged import PagedCache


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(d: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> None:
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    save_safetensors(tensors, d, num_shards)


def _logits(model, ids: list[int]) -> torch.Tensor:
    cache = PagedCache.for_model(model, num_blocks=16, block_size=4)
    (h,) = cache.step(model, [(cache.new_seq(), ids)])
    return model.compute_logits(h)


@pytest.mark.parametrize("which", ["dense", "moe_gptq"])
def test_sharded_checkpoint_loads_identically(which, tiny_dense_dir, tiny_moe_gptq_dir, tmp_path):
    src = tiny_dense_dir if which == "dense" else tiny_moe_gptq_dir
    d = _copy(src, tmp_path / "sharded")
    _rewrite(d, read_safetensors_dir(src), num_shards=3)
    assert len(list(d.glob("model-*-of-00003.safetensors"))) == 3
    one, three = load_ours(src), load_ours(d)
    assert one.weights_bytes == three.weights_bytes
    ids = prompts(int(one.config["vocab_size"]), [11], seed=0)[0]
    assert torch.equal(_logits(one, ids), _logits(three, ids))


def test_fused_expert_layout_loads_like_per_expert(tiny_moe_dir, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(str(tiny_moe_dir))
    fused = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    d = _copy(tiny_moe_dir, tmp_path / "fused")
    _rewrite(d, fused)
    a, b = load_ours(tiny_moe_dir), load_ours(d)
    ids = prompts(int(a.config["vocab_size"]), [9], seed=1)[0]
    assert torch.equal(_logits(a, ids), _logits(b, ids))


# ------------------------------------------------------------------ bad checkpoints
def _drop(d: Path, key: str) -> None:
    t = read_safetensors_dir(d)
    del t[key]
    _rewrite(d, t)


def test_missing_tensor(tiny_dense_dir, tmp_path):
    d = _copy(tiny_dense_dir, tmp_path / "m")
    _drop(d, "model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_ours(d)


def test_missing_gptq_part(tiny_moe_gptq_dir, tmp_path):
    d = _copy(tiny_moe_gptq_dir, tmp_path / "m")
    _drop(d, "model.layers.0.self_attn.o_proj.scales")
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.o_proj"):
        load_ours(d)


def test_wrong_shape(tiny_dense_dir, tmp_path):
    d = _copy(tiny_dense_dir, tmp_path / "s")
    t = read_safetensors_dir(d)
    t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 96)
    _rewrite(d, t)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\[64, 96\]"):
        load_ours(d)


def test_unknown_architecture(tiny_dense_dir, tmp_path):
    d = _copy(tiny_dense_dir, tmp_path / "a")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_ours(d)


def test_bits_not_4(tiny_moe_gptq_dir, tmp_path):
    d = _copy(tiny_moe_gptq_dir, tmp_path / "b")
    for name in ("config.json", "quantize_config.json"):
        cfg = json.loads((d / name).read_text())
        (cfg.get("quantization_config") or cfg)["bits"] = 8
        (d / name).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="bits=8"):
        load_ours(d)


def test_unreadable_safetensors_header(tiny_dense_dir, tmp_path):
    d = _copy(tiny_dense_dir, tmp_path / "h")
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a json header")
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_ours(d)


def test_no_weights_at_all(tiny_dense_dir, tmp_path):
    d = _copy(tiny_dense_dir, tmp_path / "n")
    (d / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        load_ours(d)


def test_model_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")          # no network in unit tests (tests/e2e/test_hub.py has it)
    with pytest.raises(ConfigError, match=r"org/missing-model.*HF_HUB_OFFLINE is set.*hf download") as e:
        EngineArgs(model="org/missing-model", device="cpu").create_config()
    assert str(tmp_path / "hub" / "models--org--missing-model") in str(e.value)


def test_model_id_found_in_cache(tiny_dense_dir, tmp_path):
    from onecard.hub.resolve import resolve_model

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_dense_dir, snap)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    env = Env(hf_home=None, hf_hub_cache=str(tmp_path / "hub"), kernel_backend="ref", triton_interpret=False,
              cpu_kv_cache_bytes=1 << 20, log_level="INFO")
    assert resolve_model("org/tiny", env) == snap
