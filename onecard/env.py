"""The one place that reads the environment, and the error every configuration check raises.

Contract: ``Env.read()`` returns every environment variable onecard honours, parsed and checked (a bad value
raises ``ConfigError`` naming the variable); no other module reads ``os.environ``. ``ConfigError`` is a
``ValueError`` whose message names the option, the value and what would work. This module sits below
everything else (it imports nothing of onecard), so the kernel-path table, the hub resolver, the GPU query
and the configuration all import it without import cycles. ``onecard.config`` re-exports both names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# The capabilities onecard has branches for: the values ONECARD_EMULATE_CC accepts (kernels/paths.py takes its
# CAPABILITIES from here; the tests use 70/75/80/90).
CAPABILITIES = (70, 75, 80, 86, 89, 90)
# The split-KV policies of decode attention (kernels/paths.split_kv), the values ONECARD_SPLIT_KV accepts; the
# first is the default.
SPLIT_KV_POLICIES = ("fill", "legacy")


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the option, the value and what would."""


@dataclass(slots=True)
class Env:
    hf_home: str | None
    hf_hub_cache: str | None
    kernel_backend: str            # "auto" | "ref" | "triton"  (ONECARD_KERNEL_BACKEND)
    triton_interpret: bool         # TRITON_INTERPRET=1: Triton kernels run on the CPU (tests)
    cpu_kv_cache_bytes: int        # ONECARD_CPU_KV_CACHE_BYTES: KV pool on CPU (default 256 MiB)
    log_level: str
    precompile: bool = True        # ONECARD_PRECOMPILE=0: no parallel Triton precompile at start-up
    pdl_max_tokens: int = 1        # ONECARD_PDL_MAX_TOKENS: PDL (sm90) for launches of <= this many tokens; 0 off
    hf_token: str | None = None    # HF_TOKEN (or HUGGING_FACE_HUB_TOKEN): private and gated repos
    hf_hub_offline: bool = False   # HF_HUB_OFFLINE=1: never contact the hub, the cache only
    hf_endpoint: str = "https://huggingface.co"   # HF_ENDPOINT: a mirror, or the tests' local hub server
    cuda_visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES: which GPU NVML reads (gpu_query.py)
    engine_threads: int | None = None   # ONECARD_ENGINE_THREADS: torch threads in the engine (--engine-threads)
    api_threads: int | None = None      # ONECARD_API_THREADS: templating/tokenizing threads in the API process
    cpu_count: int = 1                  # CPUs this process may run on (sched_getaffinity)
    # ONECARD_EMULATE_CC=70 (75, 80, 86, 89, 90): every capability decision (kernels/paths.py: dispatch thresholds,
    # tiles, PDL, grouped vs per-expert MoE, grouped GEMM dtype, dtype rules) takes that capability's branch on
    # the real card; Triton still compiles for the real target. For tests and benchmarks, not for serving.
    emulate_cc: int | None = None
    # ONECARD_SPLIT_KV=fill|legacy: the split-KV policy of decode attention (kernels/paths.split_kv); "legacy" is
    # the one before issue 25's tuning, kept for A/B benchmarks (bench/long_context.py).
    split_kv: str = "fill"

    @staticmethod
    def read() -> Env:
        e = os.environ
        return Env(
            hf_home=e.get("HF_HOME"),
            hf_hub_cache=e.get("HF_HUB_CACHE") or e.get("HUGGINGFACE_HUB_CACHE"),
            kernel_backend=e.get("ONECARD_KERNEL_BACKEND", "auto"),
            triton_interpret=e.get("TRITON_INTERPRET", "0") == "1",
            cpu_kv_cache_bytes=int(e.get("ONECARD_CPU_KV_CACHE_BYTES", str(256 << 20))),
            log_level=e.get("ONECARD_LOG_LEVEL", "INFO"),
            precompile=e.get("ONECARD_PRECOMPILE", "1") != "0",
            pdl_max_tokens=int(e.get("ONECARD_PDL_MAX_TOKENS", "1")),
            hf_token=e.get("HF_TOKEN") or e.get("HUGGING_FACE_HUB_TOKEN") or None,
            # huggingface_hub's own truthy spellings
            hf_hub_offline=e.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"),
            hf_endpoint=(e.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"),
            cuda_visible_devices=e.get("CUDA_VISIBLE_DEVICES"),
            engine_threads=_positive_int_env(e, "ONECARD_ENGINE_THREADS"),
            api_threads=_positive_int_env(e, "ONECARD_API_THREADS"),
            cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
            emulate_cc=_emulate_cc(e.get("ONECARD_EMULATE_CC", "")),
            split_kv=_split_kv(e.get("ONECARD_SPLIT_KV", "")),
        )


def _positive_int_env(environ, name: str) -> int | None:
    value = environ.get(name)
    if value in (None, ""):
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer (a thread count).")
    return n


def _emulate_cc(value: str) -> int | None:
    v = value.strip().lower().replace("sm", "").replace(".", "")
    if not v:
        return None
    if not v.isdigit() or int(v) not in CAPABILITIES:
        raise ConfigError(f"ONECARD_EMULATE_CC={value} is not a capability onecard has branches for; use one of "
                          f"{', '.join(map(str, CAPABILITIES))} (like 70 for a V100) or leave it unset.")
    return int(v)


def _split_kv(value: str) -> str:
    v = value.strip().lower() or SPLIT_KV_POLICIES[0]
    if v not in SPLIT_KV_POLICIES:
        raise ConfigError(f"ONECARD_SPLIT_KV={value} is not a split-KV policy; use one of "
                          f"{', '.join(SPLIT_KV_POLICIES)} or leave it unset (fill).")
    return v
