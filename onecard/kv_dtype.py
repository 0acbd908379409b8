"""KV-cache dtypes (vLLM's ``--kv-cache-dtype`` names and meanings): what each stores, its bytes, the card it
needs, and the one bytes-per-token formula that the plan, the preflight, the runner and the metrics import.

Contract (no torch here: the planner runs without it):
  ``KV_CACHE_DTYPES``: the accepted flag values. ``resolve(kv_cache_dtype, model_dtype) -> str``: the stored
  format, one of "float16" | "bfloat16" | "float32" | "fp8_e5m2" | "fp8_e4m3" ("auto" = the serving dtype,
  "fp8" = "fp8_e4m3" as in vLLM); raises ValueError naming the value for an unknown one.
  ``element_bytes(fmt)``; ``bytes_per_token(num_layers, num_kv_heads, head_dim, fmt)`` = 2 (K and V) x layers
  x kv heads x head_dim x element bytes; ``bytes_per_token_hf(hf_config, fmt)`` the same from a config.json
  (``kv_shape(hf_config)``: its layers, KV heads and head_dim).
  ``hardware_problem(fmt, cc)``: None when a card of compute capability ``cc`` (None = CPU) runs ``fmt``,
  else the reason, naming what would work.
Formats:
  fp8_e5m2  the upper byte of the fp16 value (1 sign, 5 exponent, 2 mantissa bits), rounded to nearest even on
            store; load is a shift back into an fp16. Integer ops only, so every card from sm70 runs it.
  fp8_e4m3  e4m3fn (max 448) of value / scale, rounded to nearest even and saturated to +-448, as vLLM; the
            per-layer k_scale / v_scale come from the checkpoint (1.0 with a warning when it has none). The
            conversions are hardware instructions from sm89 (Ada, Hopper), so it needs sm89+.
  Both fp8 formats store value / scale and load stored x scale (scale 1.0 unless the checkpoint gives one).
"""
from __future__ import annotations

from typing import Any

from onecard.dtypes import DTYPE_ALIASES, DTYPE_BYTES
from onecard.kernels import paths

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_FORMATS = ("fp8_e5m2", "fp8_e4m3")
_ALIASES = {"auto": None, **DTYPE_ALIASES, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_BYTES = {**DTYPE_BYTES, "fp8_e5m2": 1, "fp8_e4m3": 1}
E4M3_MIN_CC = (8, 9)


def resolve(kv_cache_dtype: str | None, model_dtype: str) -> str:
    """The stored format for a --kv-cache-dtype value and the (resolved) serving dtype."""
    kv = str(kv_cache_dtype or "auto").lower()
    if kv not in _ALIASES:
        raise ValueError(f"--kv-cache-dtype={kv_cache_dtype} is unknown; use one of {', '.join(KV_CACHE_DTYPES)}.")
    fmt = _ALIASES[kv] or _ALIASES.get(str(model_dtype).lower())
    if fmt is None:
        raise ValueError(f"serving dtype {model_dtype} has no KV-cache format; use float16, bfloat16 or float32.")
    return fmt


def is_fp8(fmt: str) -> bool:
    return fmt in FP8_FORMATS


def element_bytes(fmt: str) -> int:
    return _BYTES[fmt]


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, fmt: str) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes(fmt)


def kv_shape(hf_config: dict[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) from config.json's fields (KeyError names a missing one): the one reading of
    them (``ModelConfig``, the plan and ``bytes_per_token_hf`` use it)."""
    c = hf_config
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    return int(c["num_hidden_layers"]), kv_heads, head_dim


def bytes_per_token_hf(hf_config: dict[str, Any], fmt: str) -> int:
    """From config.json's fields (KeyError names a missing one)."""
    return bytes_per_token(*kv_shape(hf_config), fmt)


def hardware_problem(fmt: str, cc: tuple[int, int] | None) -> str | None:
    """Why a card of capability ``cc`` (None = CPU: the reference kernels run every format) cannot hold ``fmt``."""
    if cc is None:
        return None
    where = f"sm{cc[0]}{cc[1]}"
    if fmt == "fp8_e4m3" and tuple(cc) < E4M3_MIN_CC:
        return (f"--kv-cache-dtype=fp8_e4m3 (fp8) needs compute capability 8.9+ (Ada/Hopper convert e4m3 in "
                f"hardware) and this is {where}; use --kv-cache-dtype=fp8_e5m2 (same bytes, runs on sm70+) or auto.")
    if fmt == "bfloat16" and not paths.bf16_allowed(paths.as_int(cc)):
        return f"--kv-cache-dtype=bfloat16 needs compute capability 8.0+ and this is {where}; use auto."
    return None
