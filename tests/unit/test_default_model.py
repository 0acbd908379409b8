"""The bundled onecard-tiny-coder: its perplexity on a held-out snippet shipped with the tests stays under the
figure measured at release (onecard/data/onecard-tiny-coder/release_ppl.json) plus its margin, and the
checkpoint stays within the 20 MB budget and in the GPTQ format onecard serves."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

MODEL_DIR = Path(__file__).resolve().parents[2] / "onecard" / "data" / "onecard-tiny-coder"
SNIPPET = Path(__file__).resolve().parents[1] / "data" / "heldout_snippet.py"

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "config.json").exists(),
    reason=f"the bundled model is not built yet ({MODEL_DIR} is missing; run scripts/build_default_model.sh)")


def test_size_within_budget() -> None:
    total = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert total <= 20_000_000, f"{total} bytes"


def test_is_4bit_gptq_qwen3_moe() -> None:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["bits"], q["checkpoint_format"]) == ("gptq", 4, "gptq")
    assert json.loads((MODEL_DIR / "quantize_config.json").read_text()) == q
    assert (MODEL_DIR / "tokenizer.json").exists() and (MODEL_DIR / "generation_config.json").exists()


def test_heldout_snippet_perplexity_within_release_margin() -> None:
    from onecard.quant.ppl import perplexity

    rel = json.loads((MODEL_DIR / "release_ppl.json").read_text())
    ppl, n = perplexity(MODEL_DIR, [SNIPPET.read_text()], seq_len=int(rel.get("seq_len", 512)), device="cpu")
    assert n == rel["tokens"], "the tokenizer or the snippet changed since release"
    limit = rel["heldout_snippet_ppl"] * (1.0 + rel.get("margin", 0.05))
    assert ppl <= limit, f"perplexity {ppl:.3f} > release {rel['heldout_snippet_ppl']} + margin ({limit:.3f})"
