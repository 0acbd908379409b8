"""Serve preflight: the probe's and the planner's checks, run before any weight loads.

Contract: ``preflight(engine_config, cc=None, total_memory=None, free_memory=None, arch_list=None)`` returns
None or raises ``PreflightError`` (a ``ConfigError``) whose message names the cause and what would work:
an architecture onecard does not implement (by name); bf16 below sm80; FP8 weights or KV cache (needs sm89+,
not implemented); torch built without kernels for the card; a checkpoint that cannot fit the card (with the
plan's numbers and the largest --max-model-len that fits); less free memory than --gpu-memory-utilization
asks for (as vLLM). With ``engine_config.device == "cpu"`` only the architecture and dtype are checked.
On CUDA with ``cc`` None, the card is GPU 0 and every argument left None is read from it through NVML
(``onecard.gpu_query``: capability, total and free memory; ``arch_list`` from torch's compile-time list), so
the API process that runs this holds no CUDA context (~500 MiB of KV cache on the card); with an explicit ``cc`` (tests playing a V100 on a CPU machine) nothing is
detected and a None argument skips its check. Only metadata is read (config + safetensors headers),
so it finishes in well under 5 s even for a 60 GB checkpoint.
"""
from __future__ import annotations

import logging

from onecard.checkpoint_meta import read_checkpoint_meta
from onecard.config import ConfigError, EngineConfig
from onecard.hardware import arch_covers, decide, sm
from onecard.plan import GIB, architecture_problem, plan_from_config

logger = logging.getLogger(__name__)


class PreflightError(ConfigError):
    """Start-up stopped before loading: the message names the cause and the fix."""


def _detect(cc, total_memory, free_memory, arch_list, env=None):
    """GPU 0's facts through NVML (onecard.gpu_query): the API process never creates a CUDA context."""
    from onecard.gpu_query import GpuQueryError, query_gpu
    from onecard.gpu_query import arch_list as torch_arch_list
    from onecard.kernels import paths

    emulated = paths.emulated_capability()                                # ONECARD_EMULATE_CC honoured
    if emulated is not None and cc is None:
        cc = (emulated // 10, emulated % 10)
    try:
        info = query_gpu(env) if None in (cc, total_memory, free_memory) else None
        arch_list = torch_arch_list() if arch_list is None else arch_list
    except GpuQueryError as e:
        raise PreflightError(
            f"{e}. The driver may be too old for this torch's CUDA runtime, or no GPU is visible; `onecard "
            "probe` names the failing step. Use --device cpu to run without a GPU.") from None
    if info is not None:
        cc = info.cc if cc is None else cc
        total_memory = info.total_memory if total_memory is None else total_memory
        free_memory = info.free_memory if free_memory is None else free_memory
    return cc, total_memory, free_memory, arch_list


def preflight(engine_config: EngineConfig, cc: tuple[int, int] | None = None, total_memory: int | None = None,
              free_memory: int | None = None, arch_list: list[str] | None = None) -> None:
    m, cache = engine_config.model, engine_config.cache
    why = architecture_problem(m.architecture)
    if why:
        raise PreflightError(why)
    quant = m.quant.method if m.quant is not None else None
    if engine_config.device != "cuda":
        d = decide(None, m.dtype, quant, cache.kv_cache_dtype)
        if not d.allowed:
            raise PreflightError(str(d.refusal))
        return
    if cc is None:       # the real card; an explicit cc (tests, planning) means: use only what was passed
        cc, total_memory, free_memory, arch_list = _detect(cc, total_memory, free_memory, arch_list,
                                                           engine_config.env)
    cc = (int(cc[0]), int(cc[1]))
    d = decide(cc, m.dtype, quant, cache.kv_cache_dtype)
    if not d.allowed:
        raise PreflightError(str(d.refusal))
    if arch_list is not None:
        covered, reason = arch_covers(cc, arch_list)
        if not covered:
            raise PreflightError(f"this GPU is {sm(cc)} but {reason}.")
    if total_memory is None:
        return
    meta = read_checkpoint_meta(m.path, m.hf_config)
    report = plan_from_config(meta, engine_config, int(total_memory), cc, f"this {sm(cc)} GPU", m.model, quant)
    if cache.num_gpu_blocks is not None:       # a fixed pool (tests): check that pool, not the sizing
        needed = report.weights_bytes + report.activation_bytes + cache.num_gpu_blocks * cache.block_size \
            * report.kv_bytes_per_token
        if needed > total_memory:
            raise PreflightError(
                f"--num-gpu-blocks-override={cache.num_gpu_blocks} needs {needed / GIB:.2f} GiB with weights "
                f"{report.weights_gib:.2f} GiB, but the GPU has {total_memory / GIB:.2f} GiB.")
    elif report.fits is False:
        raise PreflightError(f"{m.model} cannot run on this {sm(cc)} GPU with these settings: "
                             + " ".join(r for r in report.reasons if r.startswith("does not fit")))
    if free_memory is not None and free_memory < cache.gpu_memory_utilization * total_memory:
        raise PreflightError(
            f"Free memory on device ({free_memory / GIB:.2f}/{total_memory / GIB:.2f} GiB) on startup is less "
            f"than desired GPU memory utilization ({cache.gpu_memory_utilization}, "
            f"{cache.gpu_memory_utilization * total_memory / GIB:.2f} GiB). Decrease --gpu-memory-utilization or "
            "reduce GPU memory used by other processes.")
    logger.info("preflight: %s, weights %.2f GiB, KV %s tokens, %s x %d-token sequences at once",
                sm(cc), report.weights_gib, report.kv_capacity_tokens, report.max_concurrent_at_max_len,
                m.max_model_len)
