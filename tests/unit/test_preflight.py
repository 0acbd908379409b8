"""The serve preflight: refuses, in seconds and before any weight loads, what cannot work on the card.

A V100 is played on this CPU machine by passing cc / total_memory / arch_list explicitly; the 30B checkpoint
is the sparse-header one from tests/unit/_sparse_ckpt.py.
"""
from __future__ import annotations

import json
import shutil

import pytest

from onecard.checkpoint_meta import read_checkpoint_meta
from onecard.config import ConfigError, EngineArgs
from onecard.plan import GIB, GPUS, PlanSettings, plan_from_meta
from onecard.preflight import PreflightError, preflight
from tests.unit._sparse_ckpt import bytes_read, qwen3_coder_30b

V100 = {"cc": GPUS["V100-32GB"].cc, "total_memory": int(GPUS["V100-32GB"].memory_gib * GIB),
            "arch_list": ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]}


@pytest.fixture(scope="module")
def coder_gptq(tmp_path_factory):
    return qwen3_coder_30b(tmp_path_factory.mktemp("pf") / "gptq", "gptq")


@pytest.fixture(scope="module")
def coder_bf16(tmp_path_factory):
    return qwen3_coder_30b(tmp_path_factory.mktemp("pf") / "bf16", "bf16")


def cuda_config(path, **kw):
    return EngineArgs(model=str(path), device="cuda", **kw).create_config()


def test_coder_gptq_on_v100_passes_fast(coder_gptq):
    before = bytes_read()
    preflight(cuda_config(coder_gptq, max_model_len=65536, max_num_seqs=16), **V100)
    assert bytes_read() - before < 64 << 20           # headers only, not the 16 GB of tensors


def test_too_long_context_names_largest_that_fits(coder_gptq):
    cfg = cuda_config(coder_gptq, max_num_seqs=16)            # default: max_position_embeddings = 262144
    with pytest.raises(PreflightError) as e:
        preflight(cfg, **V100)
    expect = plan_from_meta(read_checkpoint_meta(coder_gptq), PlanSettings(max_num_seqs=16), V100["total_memory"],
                            V100["cc"])
    msg = str(e.value)
    assert f"largest --max-model-len that fits is {expect.largest_max_model_len}" in msg
    assert f"weights {expect.weights_gib:.2f} GiB" in msg and "262144" in msg
    # The suggestion really works.
    preflight(cuda_config(coder_gptq, max_num_seqs=16, max_model_len=expect.largest_max_model_len), **V100)


def test_bf16_checkpoint_cannot_fit_v100(coder_bf16):
    with pytest.raises(PreflightError, match="does not fit: weights 56.87 GiB \\(61.1 GB\\)"):
        preflight(cuda_config(coder_bf16, dtype="float16", max_model_len=65536), **V100)


def test_bf16_refused_below_sm80(tiny_moe_dir):
    cfg = cuda_config(tiny_moe_dir, dtype="bfloat16")
    for cc in [(7, 0), (7, 5)]:
        with pytest.raises(PreflightError, match="bfloat16 needs compute capability 8.0"):
            preflight(cfg, cc=cc, total_memory=16 * GIB)
    preflight(cfg, cc=(8, 0), total_memory=16 * GIB, arch_list=["sm_80"])


def test_fp8_kv_by_card(tiny_moe_gptq_dir):
    cfg = cuda_config(tiny_moe_gptq_dir)
    cfg.cache.kv_cache_dtype = "fp8"        # e4m3: sm89+, refused on a V100 naming what runs there
    with pytest.raises(PreflightError, match="8.9.*fp8_e5m2"):
        preflight(cfg, cc=(7, 0), total_memory=32 * GIB)
    preflight(cfg, cc=(9, 0), total_memory=140 * GIB)
    cfg.cache.kv_cache_dtype = "fp8_e5m2"   # every card
    preflight(cfg, cc=(7, 0), total_memory=32 * GIB)


def test_unsupported_architecture_named(tmp_path, tiny_moe_dir):
    root = tmp_path / "next"
    shutil.copytree(tiny_moe_dir, root)
    c = json.loads((root / "config.json").read_text())
    c["architectures"] = ["Qwen3NextForCausalLM"]
    (root / "config.json").write_text(json.dumps(c))
    for device in ("cpu", "cuda"):
        with pytest.raises(PreflightError, match="Qwen3NextForCausalLM.*hybrid attention"):
            preflight(EngineArgs(model=str(root), device=device).create_config(), cc=(9, 0), total_memory=140 * GIB)


def test_torch_without_kernels_for_the_card(coder_gptq):
    cfg = cuda_config(coder_gptq, max_model_len=65536)
    with pytest.raises(PreflightError, match="without sm_70 kernels"):
        preflight(cfg, cc=(7, 0), total_memory=V100["total_memory"], arch_list=["sm_80", "sm_90", "sm_100"])


def test_free_memory_below_utilization(coder_gptq):
    cfg = cuda_config(coder_gptq, max_model_len=65536)
    with pytest.raises(PreflightError, match="Free memory on device"):
        preflight(cfg, **V100, free_memory=V100["total_memory"] // 2)


def test_cpu_checks_architecture_and_dtype_only(tiny_moe_gptq_dir, tiny_dense_dir):
    preflight(EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu").create_config())
    preflight(EngineArgs(model=str(tiny_dense_dir), device="cpu", dtype="bfloat16").create_config())
    assert issubclass(PreflightError, ConfigError)
