"""--kv-cache-dtype: names and formats (onecard/kv_dtype.py), the engine args, and the plan in tokens.

References: the byte arithmetic of the formats (2 x layers x kv heads x head_dim x element bytes, fp16's 98,304
B/token for Qwen3-Coder-30B from REFERENCE.md), and the plan's fp16 figures on the same card (the KV budget
in bytes does not depend on the KV dtype, so fp8 holds twice the tokens, to a block).
"""
from __future__ import annotations

import math

import pytest

from onecard import kv_dtype
from onecard.config import ConfigError, EngineArgs
from onecard.kernels import paths
from onecard.plan import AGENT_CONTEXT, PlanSettings, find_gpu, plan_from_meta
from tests.unit._sparse_ckpt import qwen3_coder_30b

CODER = {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "hidden_size": 2048}


@pytest.mark.parametrize("given,model,fmt", [
    ("auto", "float16", "float16"), ("auto", "float32", "float32"), ("fp8", "float16", "fp8_e4m3"),
    ("fp8_e4m3", "bfloat16", "fp8_e4m3"), ("fp8_e5m2", "float16", "fp8_e5m2"), ("float16", "float32", "float16"),
    ("FP8_E5M2", "float16", "fp8_e5m2")])
def test_resolve(given, model, fmt):
    assert kv_dtype.resolve(given, model) == fmt


def test_unknown_names_the_value():
    with pytest.raises(ValueError, match="--kv-cache-dtype=int4 is unknown.*fp8_e5m2"):
        kv_dtype.resolve("int4", "float16")


def test_bytes_per_token_halves_with_fp8():
    assert kv_dtype.bytes_per_token_hf(CODER, "float16") == 98_304
    for fmt in kv_dtype.FP8_FORMATS:
        assert kv_dtype.bytes_per_token_hf(CODER, fmt) == 49_152
    assert kv_dtype.bytes_per_token_hf(CODER, "float32") == 196_608


@pytest.mark.parametrize("cc", [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), None])
def test_hardware_rule(cc):
    assert kv_dtype.hardware_problem("fp8_e5m2", cc) is None
    why = kv_dtype.hardware_problem("fp8_e4m3", cc)
    assert (why is None) == (cc is None or cc >= (8, 9))


def test_engine_args_accept_fp8_and_refuse_unknown(tiny_moe_gptq_dir):
    cfg = EngineArgs(model=str(tiny_moe_gptq_dir), kv_cache_dtype="fp8_e5m2", device="cpu").create_config()
    assert cfg.cache.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ConfigError, match="--kv-cache-dtype=fp7"):
        EngineArgs(model=str(tiny_moe_gptq_dir), kv_cache_dtype="fp7", device="cpu").create_config()


@pytest.fixture(scope="module")
def coder_meta(tmp_path_factory):
    from onecard.checkpoint_meta import read_checkpoint_meta

    return read_checkpoint_meta(qwen3_coder_30b(tmp_path_factory.mktemp("coder") / "gptq", "gptq"))


def _plan(meta, gpu: str, kv: str):
    spec = find_gpu(gpu)
    flags = {"max_model_len": 65536, "max_num_seqs": 16, "max_num_batched_tokens": 8192, "kv_cache_dtype": kv}
    return plan_from_meta(meta, PlanSettings(**flags), int(spec.memory_gib * 2**30), spec.cc, spec.name)


def test_plan_v100_fp8_e5m2_twice_the_tokens(coder_meta):
    fp16, fp8 = _plan(coder_meta, "V100-32GB", "auto"), _plan(coder_meta, "V100-32GB", "fp8_e5m2")
    assert fp8.ok and fp16.ok and fp8.kv_cache_dtype == "fp8_e5m2"
    assert fp8.kv_bytes_per_token * 2 == fp16.kv_bytes_per_token == 98_304
    # the same budget, less the fp8 bytes the prefill attention gathers before converting them (below sm80 it runs
    # SDPA over a sequence's K and V in fp16: paths.prefill_sdpa_workspace), so twice the tokens less those bytes'
    gather_fp8 = (paths.prefill_sdpa_workspace(65536, 0, 0, 4, 128, 2, 1)
                  - paths.prefill_sdpa_workspace(65536, 0, 0, 4, 128, 2, 2))
    assert gather_fp8 == 2 * 65536 * 4 * 128
    assert fp16.kv_capacity_bytes - fp8.kv_capacity_bytes == gather_fp8
    assert 0 <= 2 * fp16.kv_capacity_tokens - fp8.kv_capacity_tokens <= gather_fp8 // fp8.kv_bytes_per_token + 16
    assert fp8.max_concurrent_at_max_len >= 2 * fp16.max_concurrent_at_max_len
    blocks_32k = math.ceil(AGENT_CONTEXT / 16)
    assert fp8.agent_context == AGENT_CONTEXT
    assert fp8.max_concurrent_at_agent_context == fp8.num_blocks // blocks_32k
    assert fp8.max_concurrent_at_agent_context >= 2 * fp16.max_concurrent_at_agent_context >= 2
    assert f"{AGENT_CONTEXT}-token agent context: {fp8.max_concurrent_at_agent_context}" in fp8.render()


def test_plan_e4m3_by_card(coder_meta):
    v100 = _plan(coder_meta, "V100-32GB", "fp8")
    assert not v100.ok and "8.9" in v100.refusal and "fp8_e5m2" in v100.refusal
    h100 = _plan(coder_meta, "H100-80GB", "fp8")
    assert h100.ok and h100.kv_cache_dtype == "fp8_e4m3" and h100.kv_bytes_per_token == 49_152
