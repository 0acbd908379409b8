"""GPU-only: the Triton backend, CUDA graphs and async scheduling give the reference greedy tokens (H200 run)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_and_graphs_match_reference():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_checks", Path(__file__).parents[2] / "bench" / "gpu_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    check_results(mod.main())


def check_results(res: dict) -> None:
    """gpu_checks' results: no errors; fp32 models and graphs/async token for token; GPTQ near-ties allowed."""
    for name, r in res.items():
        if name.startswith("_"):                  # records (the capability used), not checks
            continue
        assert "error" not in r, (name, r)
        if "gptq" not in name:
            assert r["identical"], (name, r)     # fp32 models: token-for-token (exact fp32 dots)
        elif name.endswith(("graphs_vs_eager", "async_vs_sync")):
            assert r["identical"], (name, r)     # same kernels and batches: must not change a token
        else:
            # fp16 GPTQ, Triton vs reference: different fp16 rounding points flip near-ties in this tiny random
            # model (H200, 2026-12-02: 80% matched prefix); the full-size check compares logits instead.
            assert r["prefix_agreement"] >= 0.75, (name, r)
