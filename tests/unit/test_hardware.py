"""The capability decision table (onecard.hardware.decide) and torch arch-list coverage."""
from __future__ import annotations

import pytest

from onecard.hardware import allowed_dtypes, arch_covers, decide

SM70, SM75, SM80, SM86, SM89, SM90 = (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)
GPUS = [SM70, SM75, SM80, SM86, SM89, SM90]
ALL = GPUS + [None]                                    # None = CPU


@pytest.mark.parametrize("cc", ALL)
def test_fp16_gptq_allowed_everywhere(cc):
    d = decide(cc, "float16", "gptq", "auto")
    assert d.allowed and d.refusal is None
    assert set(d.backends) == {"attention", "dense_gemm", "moe", "sampling"}


@pytest.mark.parametrize("cc", ALL)
def test_bf16_needs_sm80(cc):
    d = decide(cc, "bfloat16", None, "auto")
    if cc is not None and cc < (8, 0):
        assert not d.allowed
        assert "8.0" in d.refusal and f"sm{cc[0]}{cc[1]}" in d.refusal and "float16" in d.refusal
    else:
        assert d.allowed, d.refusal
    # A bf16 KV cache under an fp16 model follows the same rule.
    kv = decide(cc, "float16", None, "bfloat16")
    assert kv.allowed == (cc is None or cc >= (8, 0))


@pytest.mark.parametrize("cc", ALL)
def test_fp8_e5m2_kv_allowed_on_every_card(cc):
    d = decide(cc, "float16", "gptq", "fp8_e5m2")
    assert d.allowed, d.refusal
    assert any("fp8_e5m2" in r for r in d.reasons)


@pytest.mark.parametrize("cc", ALL)
@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3"])
def test_fp8_e4m3_kv_needs_sm89(cc, kv):
    d = decide(cc, "float16", "gptq", kv)
    if cc is None or cc >= (8, 9):                     # CPU: the reference kernels convert in software
        assert d.allowed, d.refusal
    else:                                              # the reason names the card, the need and what works
        assert not d.allowed
        assert "8.9" in d.refusal and f"sm{cc[0]}{cc[1]}" in d.refusal and "fp8_e5m2" in d.refusal


def test_unknown_kv_dtype_refused():
    d = decide((9, 0), "float16", "gptq", "int4")
    assert not d.allowed and "--kv-cache-dtype=int4" in d.refusal and "fp8_e5m2" in d.refusal


@pytest.mark.parametrize("cc", ALL)
def test_fp8_weights(cc):
    d = decide(cc, "float16", "fp8", "auto")
    assert not d.allowed
    if cc is None or cc < (8, 9):
        assert "8.9" in d.refusal
    else:
        assert "not implemented" in d.refusal


@pytest.mark.parametrize("cc", ALL)
def test_gptq_bf16_refused_like_vllm(cc):
    d = decide(cc, "bfloat16", "gptq", "auto")
    assert not d.allowed and "GPTQ" in d.refusal and "float16" in d.refusal


@pytest.mark.parametrize("cc", GPUS)
def test_gptq_fp32_refused_on_gpu(cc):
    assert not decide(cc, "float32", "gptq", "auto").allowed
    assert decide(None, "float32", "gptq", "auto").allowed    # CPU reference path runs fp32


@pytest.mark.parametrize("cc", [(6, 0), (6, 1), (5, 2)])
def test_below_sm70_refused(cc):
    d = decide(cc, "float16", "gptq", "auto")
    assert not d.allowed and "7.0" in d.refusal


def test_unknown_quantization_and_dtype():
    assert "awq" in decide(SM90, "float16", "awq", "auto").refusal
    assert not decide(SM90, "float8", None, "auto").allowed
    assert decide(SM90, "half", "gptq_marlin", "auto").allowed   # vLLM's alias names are accepted


@pytest.mark.parametrize("cc", [SM70, SM75])
def test_pre_ampere_backends(cc):
    b = decide(cc, "float16", "gptq", "auto").backends
    assert "dequantize + cuBLAS" in b["dense_gemm"] and "tl.dot has no tensor cores before sm80" in b["dense_gemm"]
    assert "triton w4a16 GEMV" in b["dense_gemm"]
    assert b["moe"].startswith("prefill (>= 256 tokens): dequantize + one cuBLAS GEMM per expert")
    assert b["attention"].startswith("triton paged attention") and "PyTorch SDPA, memory-efficient" in b["attention"]


@pytest.mark.parametrize("cc", [SM80, SM86, SM89, SM90])
def test_ampere_plus_backends(cc):
    b = decide(cc, "float16", "gptq", "auto").backends
    for op in ("attention", "moe"):
        assert "tensor cores" in b[op] and "cuBLAS" not in b[op]
    assert "SDPA" not in b["attention"]                                  # tl.dot has tensor cores: the kernel
    # dense GEMMs of prefill size go to cuBLAS on every GPU (dispatch, kernels/paths.DENSE_CUBLAS_MIN_M): the
    # description says so (it used to claim Triton only)
    assert "tensor cores" in b["dense_gemm"] and "(>= 128 tokens): dequantize + cuBLAS" in b["dense_gemm"]


def test_cpu_backends_reference():
    b = decide(None, "float32", "gptq", "auto").backends
    for op in ("attention", "dense_gemm", "moe"):
        assert b[op].startswith("reference PyTorch")


def test_allowed_dtypes_table():
    v100, h200 = allowed_dtypes(SM70), allowed_dtypes(SM90)
    assert v100["float16"] == "allowed" and v100["bfloat16"] != "allowed"
    assert h200["bfloat16"] == "allowed" and "not implemented" in h200["fp8"]
    assert v100["kv fp8_e5m2"] == "allowed" and "8.9" in v100["kv fp8_e4m3"]
    assert h200["kv fp8_e5m2"] == h200["kv fp8_e4m3"] == "allowed"


@pytest.mark.parametrize("cc,arch,ok", [
    (SM70, ["sm_70", "sm_80"], True),
    (SM86, ["sm_80", "sm_90"], True),          # sm_80 cubin runs on sm86 (same major, lower minor)
    (SM80, ["sm_86", "sm_90"], False),         # a newer minor does not run on an older one
    (SM70, ["sm_75", "sm_80", "sm_90", "sm_100"], False),   # the Error 803 / V100-less build case
    (SM90, ["sm_80", "compute_80"], True),     # PTX is JIT-compiled forward
    (SM70, ["sm_80", "compute_80"], False),
    (SM70, [], False),
])
def test_arch_covers(cc, arch, ok):
    covered, why = arch_covers(cc, arch)
    assert covered == ok
    if not ok:
        assert f"sm_{cc[0]}{cc[1]}" in why
