"""The serving dtype: its names, its bytes, and the one rule that turns ``--dtype`` into the dtype served.

Contract (no torch here: the planner runs without it):
  ``DTYPE_ALIASES`` / ``normalize_dtype(name)``: "half", "fp16", "bf16", "float", ... -> "float16" |
  "bfloat16" | "float32" (None for an unknown name). ``DTYPE_BYTES``: bytes per element of each.
  ``serving_dtype(requested, hf_config, quantized, device, cc)``: what ``create_config`` serves, for serve,
  ``LLM`` and ``plan`` alike. ``auto``: GPTQ runs float16 on a GPU and float32 on the CPU; otherwise the
  checkpoint's dtype on a GPU (bf16 below sm80 falls back to float16, as vLLM; ``cc`` None = unknown card: no
  fallback) and float32 on the CPU. An explicit dtype is served as given; bf16 with GPTQ is refused (as vLLM).
  Raises ``ConfigError`` naming ``--dtype``. ``needs_capability(...)``: whether that answer depends on ``cc``
  (only then does serve ask the GPU for it).
"""
from __future__ import annotations

from typing import Any

from onecard.env import ConfigError
from onecard.kernels import paths

DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float16": "float16", "bf16": "bfloat16",
                 "bfloat16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32"}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def normalize_dtype(dtype: str) -> str | None:
    return DTYPE_ALIASES.get(str(dtype).lower())


def checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype config.json declares (``torch_dtype``, or transformers 5's ``dtype``); float32 if none."""
    return normalize_dtype(str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")) or "float32"


def needs_capability(requested: str, hf_config: dict[str, Any], quantized: bool, device: str) -> bool:
    """True when ``serving_dtype`` depends on the card's capability (auto, a bf16 checkpoint, on a GPU)."""
    return requested == "auto" and not quantized and device == "cuda" and checkpoint_dtype(hf_config) == "bfloat16"


def serving_dtype(requested: str, hf_config: dict[str, Any], quantized: bool, device: str,
                  cc: tuple[int, int] | None) -> str:
    if requested == "auto":
        if quantized:
            return "float16" if device == "cuda" else "float32"
        if device != "cuda":
            return "float32"
        dtype = checkpoint_dtype(hf_config)
        if dtype == "bfloat16" and cc is not None and not paths.bf16_allowed(paths.as_int(cc)):
            return "float16"   # as vLLM: bf16 needs sm80+, so "auto" falls back to fp16
        return dtype
    dtype = normalize_dtype(requested)
    if dtype is None:
        raise ConfigError(f"--dtype={requested} is unknown; use auto, float16, bfloat16 or float32.")
    if quantized and dtype == "bfloat16":
        raise ConfigError("--dtype=bfloat16 is not supported with GPTQ (as in vLLM); use --dtype=float16.")
    return dtype
