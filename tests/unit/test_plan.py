"""`onecard plan` on checkpoints whose safetensors headers describe real shapes (sparse files, no data).

References: safetensors' own header reader (names, dtypes, shapes), the real loader's ``weights_bytes`` on
the tiny fixtures, and the plan's own suggestions fed back into it (the largest max_model_len that fits
must fit, one block more must not).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from onecard.checkpoint_meta import read_checkpoint_meta, read_safetensors_header
from onecard.config import ConfigError, EngineArgs
from onecard.plan import GPUS, PlanSettings, find_gpu, main_plan, plan, plan_from_meta, weight_bytes
from tests.unit._sparse_ckpt import (
    QWEN3_CODER_30B,
    bytes_read,
    qwen3_coder_30b,
    qwen3_coder_tensors,
    write_checkpoint,
)

V100 = ["--gpu", "V100-32GB", "--gpu-memory-utilization", "0.90"]


@pytest.fixture(scope="module")
def coder_gptq(tmp_path_factory):
    return qwen3_coder_30b(tmp_path_factory.mktemp("coder") / "gptq", "gptq")


@pytest.fixture(scope="module")
def coder_bf16(tmp_path_factory):
    return qwen3_coder_30b(tmp_path_factory.mktemp("coder") / "bf16", "bf16")


@pytest.fixture(scope="module")
def coder_gptq_meta(coder_gptq):
    return read_checkpoint_meta(coder_gptq)


def v100_plan(meta, **settings):
    spec = find_gpu("V100-32GB")
    return plan_from_meta(meta, PlanSettings(**settings), int(spec.memory_gib * 2**30), spec.cc, spec.name)


def run_plan(capsys, *argv) -> tuple[int, dict]:
    code = main_plan([*map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


def small_moe(root, **overrides):
    cfg = {**QWEN3_CODER_30B, "num_hidden_layers": 2, "num_experts": 4, "vocab_size": 512, **overrides}
    return write_checkpoint(root, cfg, qwen3_coder_tensors(cfg, "bf16"), shards=2)


# ------------------------------------------------------------------ metadata reader
def test_header_reader_matches_safetensors(coder_gptq, tiny_moe_gptq_dir):
    for f in [coder_gptq / "model-00001-of-00004.safetensors", *sorted(tiny_moe_gptq_dir.glob("*.safetensors"))]:
        ours = read_safetensors_header(f)
        with safe_open(str(f), framework="pt") as h:
            keys = list(h.keys())
            assert sorted(ours) == sorted(keys)
            for k in keys[:: max(1, len(keys) // 200)]:
                s = h.get_slice(k)
                assert list(ours[k].shape) == s.get_shape() and ours[k].dtype == s.get_dtype()


def test_truncated_shard_is_named(tmp_path):
    root = small_moe(tmp_path / "m")
    f = root / "model-00002-of-00002.safetensors"
    with f.open("r+b") as fh:
        fh.truncate(f.stat().st_size - 1)
    with pytest.raises(ConfigError, match="truncated"):
        read_checkpoint_meta(root)


def resident_bytes(model) -> int:
    """Bytes of every weight tensor the loaded model holds (deduplicated; the RoPE table is not a weight)."""
    from onecard.kernels.types import GPTQWeight

    seen: dict[int, int] = {}
    for mod in model.modules():
        for name, v in vars(mod).items():
            parts = [v] if isinstance(v, torch.Tensor) else \
                [x for x in (v.qweight, v.qzeros, v.scales, v.g_idx) if x is not None] if isinstance(v, GPTQWeight) else []
            for t in parts:
                if name != "cos_sin":
                    seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("fixture,dtype", [("tiny_moe_gptq_dir", torch.float32), ("tiny_moe_dir", torch.float32),
                                           ("tiny_moe_dir", torch.float16), ("tiny_dense_dir", torch.bfloat16)])
def test_weight_bytes_match_the_loaded_model(request, fixture, dtype):
    from onecard.models.loader import load_model

    path = request.getfixturevalue(fixture)
    cfg = EngineArgs(model=str(path), device="cpu").create_config()
    model = load_model(cfg.model, torch.device("cpu"), dtype)
    name = str(dtype).removeprefix("torch.")
    assert weight_bytes(read_checkpoint_meta(path), name, "cpu")[0] == resident_bytes(model)


def test_fp32_checkpoint_served_fp16_is_half(tiny_moe_dir):
    meta = read_checkpoint_meta(tiny_moe_dir)
    assert weight_bytes(meta, "float16")[0] * 2 == weight_bytes(meta, "float32")[0] == meta.stored_bytes


# ------------------------------------------------------------------ the target model
def test_coder_gptq_fits_v100(capsys, coder_gptq, coder_gptq_meta):
    before = bytes_read()
    code, d = run_plan(capsys, coder_gptq, *V100, "--max-model-len", 65536, "--max-num-seqs", 16)
    assert bytes_read() - before < 64 << 20           # headers only, not the 16 GB of tensors
    assert code == 0 and d["fits"] is True and d["allowed"] is True, d["reasons"]
    assert 15.5 <= d["weights_gib"] <= 17.5
    c = QWEN3_CODER_30B
    assert d["kv_bytes_per_token"] == 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2
    assert d["kv_bytes_per_token"] == 98_304
    assert d["max_concurrent_at_max_len"] >= 1
    assert d["kv_capacity_tokens"] >= 65536 and d["kv_capacity_tokens"] % 16 == 0
    assert d["kv_capacity_tokens"] * d["kv_bytes_per_token"] <= d["kv_capacity_bytes"]
    budget = find_gpu("V100-32GB").memory_gib * 0.9 * 2**30
    used = d["weights_bytes"] + d["activation_bytes"] + d["kv_capacity_bytes"]
    assert used <= budget and budget - used < 16 * d["kv_bytes_per_token"] + 1     # KV takes all the rest
    assert d["max_concurrent_at_max_len"] == d["kv_capacity_tokens"] // 65536
    # Weights on the device are below the bytes on disk (trivial g_idx is not kept).
    assert d["weights_bytes"] < coder_gptq_meta.stored_bytes


def test_coder_gptq_default_len_names_largest_that_fits(capsys, coder_gptq, coder_gptq_meta):
    code, d = run_plan(capsys, coder_gptq, *V100, "--max-num-seqs", 16)
    assert code == 1 and d["fits"] is False and d["max_model_len"] == 262144
    best = d["largest_max_model_len"]
    assert best and any(f"largest --max-model-len that fits is {best}" in r for r in d["reasons"])
    assert v100_plan(coder_gptq_meta, max_num_seqs=16, max_model_len=best).fits is True
    assert v100_plan(coder_gptq_meta, max_num_seqs=16, max_model_len=best + 16).fits is False


def test_largest_max_num_seqs(coder_gptq_meta):
    fit = v100_plan(coder_gptq_meta, max_model_len=65536, max_num_seqs=16)
    # A length that just fits with 16 sequences; thousands of sequences' logits then push it out.
    best = fit.largest_max_model_len
    r = v100_plan(coder_gptq_meta, max_model_len=best, max_num_seqs=8192)
    assert r.fits is False and r.largest_max_num_seqs is not None and 16 <= r.largest_max_num_seqs < 8192
    assert any(f"--max-num-seqs up to {r.largest_max_num_seqs}" in x for x in r.reasons)
    assert v100_plan(coder_gptq_meta, max_model_len=best, max_num_seqs=r.largest_max_num_seqs).fits is True
    assert v100_plan(coder_gptq_meta, max_model_len=best, max_num_seqs=r.largest_max_num_seqs + 1).fits is False


def test_expert_dequant_scratch_is_one_stacked_projection(coder_gptq_meta):
    """Prefill of >= 256 tokens dequantizes one projection of all 128 experts at a time (fused_moe/grouped.py,
    on every GPU): the plan counts [E, K, N] at the serving dtype, the largest of gate/up [2048, 768] and down
    [768, 2048]."""
    from onecard import plan as plan_mod
    from onecard.kernels.fused_moe.grouped import GROUPED_MIN_TOKENS

    assert plan_mod.GROUPED_MOE_MIN_TOKENS == GROUPED_MIN_TOKENS
    for cc in ((7, 0), (9, 0)):
        _, parts = plan_mod.activation_bytes(coder_gptq_meta, 8192, 16, 2, cc)
        assert parts["expert_dequant_scratch"] == 128 * 2048 * 768 * 2
        _, parts = plan_mod.activation_bytes(coder_gptq_meta, GROUPED_MIN_TOKENS - 1, 16, 2, cc)
        assert "expert_dequant_scratch" not in parts


def test_coder_bf16_does_not_fit_v100(capsys, coder_bf16):
    assert abs(read_checkpoint_meta(coder_bf16).stored_bytes / 1e9 - 61.1) < 0.05
    for extra in ([], ["--dtype", "float16"]):
        code, d = run_plan(capsys, coder_bf16, *V100, "--max-model-len", 65536, *extra)
        assert code == 1 and d["fits"] is False
        assert any("does not fit" in r and "61.1 GB" in r and "V100-32GB" in r for r in d["reasons"]), d["reasons"]
    # On an H200 the same weights fit, in bf16.
    code, d = run_plan(capsys, coder_bf16, "--gpu", "H200", "--max-model-len", 65536)
    assert code == 0 and d["fits"] and d["dtype"] == "bfloat16"


def test_fp8_refused_on_v100(capsys, coder_gptq, coder_gptq_meta, tmp_path):
    code, d = run_plan(capsys, coder_gptq, *V100, "--max-model-len", 65536, "--kv-cache-dtype", "fp8")
    assert code == 1 and d["allowed"] is False and "8.9" in d["refusal"]
    h200 = find_gpu("H200")
    r = plan_from_meta(coder_gptq_meta, PlanSettings(max_model_len=65536, kv_cache_dtype="fp8"),
                       int(h200.memory_gib * 2**30), h200.cc, h200.name)
    assert r.ok, r.refusal                                 # e4m3 runs on sm89+
    fp8 = small_moe(tmp_path / "fp8", quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    code, d = run_plan(capsys, fp8, "--gpu", "V100-32GB", "--max-model-len", 4096)
    assert code == 1 and d["quantization"] == "fp8" and "8.9" in d["refusal"]


def test_unsupported_architecture_named(capsys, tmp_path):
    root = small_moe(tmp_path / "next", architectures=["Qwen3NextForCausalLM"])
    code, d = run_plan(capsys, root, "--gpu", "H200", "--max-model-len", 4096)
    assert code == 1 and d["allowed"] is False
    assert "Qwen3NextForCausalLM" in d["refusal"] and "hybrid attention" in d["refusal"]


def test_gpu_table_and_memory_only(capsys, tmp_path):
    for name in ("V100-16GB", "V100-32GB", "T4", "A10", "A100-40GB", "A100-80GB", "L40S", "H100-80GB", "H200"):
        assert name in GPUS and find_gpu(name.lower()) is GPUS[name]
    assert find_gpu("NVIDIA H200") is GPUS["H200"] and find_gpu("Tesla V100-SXM2-32GB").name == "V100-32GB"
    assert find_gpu("NVIDIA H100 80GB HBM3").name == "H100-80GB" and find_gpu("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    root = small_moe(tmp_path / "m")
    assert main_plan([str(root), "--gpu", "B9000"]) == 2
    assert "unknown" in capsys.readouterr().err
    code, d = run_plan(capsys, root, "--gpu-memory-gib", 24, "--max-model-len", 4096)
    assert code == 0 and d["fits"] and abs(d["total_memory_gib"] - 24) < 1e-6


def test_serve_flags_accepted_and_text_output(capsys, tmp_path):
    root = small_moe(tmp_path / "m")
    code = main_plan([str(root), "--gpu", "A10", "--max-model-len", "4k", "--port", "9000",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--served-model-name", "a", "b"])
    out = capsys.readouterr().out
    assert code == 0 and "FITS" in out and "B/token" in out


def test_plan_reads_no_tensor_data(coder_bf16, tmp_path):
    # A 61 GB checkpoint is planned from its headers; the sparse files hold almost nothing on disk.
    on_disk = sum(f.stat().st_blocks * 512 for f in coder_bf16.glob("*.safetensors"))
    assert on_disk < 50 << 20
    before = bytes_read()
    plan(str(coder_bf16), None, gpu_name="H200")
    assert bytes_read() - before < 64 << 20           # headers only, not the 61 GB of tensors


def test_plan_reports_agent_concurrency_and_the_host_tier(capsys, coder_gptq):
    """Issue 23's plan line: tokens on the GPU, sequences at max-model-len and at a 32k agent context, and the
    cached prefix tokens a --kv-offloading-size tier holds (whatever the KV dtype's bytes per token are)."""
    args = [coder_gptq, *V100, "--max-model-len", 65536, "--max-num-seqs", 16]
    code, off = run_plan(capsys, *args)
    assert code == 0 and off["host_tier_tokens"] == 0 and off["kv_offloading_size_gib"] is None
    assert off["agent_context"] == 32768
    assert off["max_concurrent_at_agent_context"] == off["num_blocks"] // (32768 // 16) >= 1
    assert off["max_concurrent_at_agent_context"] >= off["max_concurrent_at_max_len"]
    for flag in ("--kv-offloading-size", "--kv-offload-gib"):
        _, on = run_plan(capsys, *args, flag, 64)
        block = 16 * on["kv_bytes_per_token"]
        assert on["host_tier_blocks"] == 64 * 2**30 // block and on["host_tier_tokens"] == 16 * on["host_tier_blocks"]
        assert on["kv_capacity_tokens"] == off["kv_capacity_tokens"]            # the GPU side is unchanged
        assert on["host_memory_available_gib"] is not None
    code = main_plan([str(coder_gptq), *V100, "--max-model-len", "65536", "--kv-offloading-size", "64"])
    text = capsys.readouterr().out
    assert code == 0 and "32768-token agent context" in text and "cached prefix tokens" in text
    # with the 8-bit KV dtype the same line reports what the plan's bytes per token give (refused until it lands)
    _, fp8 = run_plan(capsys, *args, "--kv-cache-dtype", "fp8_e5m2", "--kv-offloading-size", 64)
    assert fp8["host_tier_tokens"] == 16 * (64 * 2**30 // (16 * fp8["kv_bytes_per_token"]))
