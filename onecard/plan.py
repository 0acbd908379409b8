"""Memory plan from metadata only: will this checkpoint, with these serve flags, run on this card?

Contract: ``plan(model, args, gpu_memory_gib=None, gpu_name=None) -> PlanReport``; ``args`` is ``EngineArgs``
or anything with its attribute names (missing ones take EngineArgs' defaults). ``model`` is a directory, a
cached hub id, or a hub id read remotely (``checkpoint_meta_for``: config and safetensors headers only, a few
hundred KB). The options resolve through ``config.create_config`` for a GPU of the card's capability, the
function serve and ``LLM`` use, so the plan and the server cannot disagree on the dtype, the context length,
the token budget or the KV format. ``plan_from_meta(meta, engine_args, ...)`` plans an already-read
``CheckpointMeta``; ``plan_from_config(meta, engine_config, ...)`` does the arithmetic on a resolved
``EngineConfig`` (the serve preflight uses it). Nothing reads tensor data. ``PlanSettings`` is ``EngineArgs``.

Arithmetic (bytes; "A" = serving-dtype bytes, T = --max-num-batched-tokens, S = min(--max-num-seqs, T)):
  weights   GPTQ qweight/qzeros as stored (int32), scales at fp16, g_idx only with desc_act (the loader drops
            a trivial g_idx), float tensors at the serving dtype (bf16 served as fp16 = same bytes, fp32 served
            as fp16 = half), other tensors as stored.
  kv/token  2 x layers x kv_heads x head_dim x kv-dtype bytes (kv_dtype.bytes_per_token: 1 for fp8_e5m2 /
            fp8_e4m3, 2 for fp16 / bf16, 4 for fp32).
  activations  T x [4H (residual, hidden, normed, layer out) + (Hq + 2Hkv) D + Hq D (qkv, attn out)] x A
            + MoE: T x top_k x (3 I_moe + H) x A + T x E x 4 (router) + T x top_k x 8 (ids, weights)
              or dense MLP: T x 3 I x A
            + logits: S x vocab x 4 x 2 (fp32 logits and probabilities in the sampler)
            + with GPTQ where T reaches the dense cuBLAS path (kernels/paths.py: 128 tokens, 65 below sm80; or
              the capability is unknown): the largest dequantized dense weight K x N x A
            + MoE with GPTQ and T >= 256 (paths.GROUPED_MIN_TOKENS): one projection of all experts dequantized, E x K x N x A (the prefill
              path dequantizes them for cuBLAS / the grouped GEMM, one projection at a time)
            + 0.75 GiB fixed: CUDA context, cuBLAS/Triton workspaces, CUDA graph pool, allocator slack.
  budget    total x --gpu-memory-utilization (as vLLM); KV = budget - weights - activations, or
            --kv-cache-memory-bytes when given; blocks = KV // (block_size x kv/token).
  fits      the weights and activations fit the budget and the KV cache holds at least one --max-model-len
            sequence (vLLM's start-up rule); otherwise ``reasons`` names the largest max_model_len and the
            largest max_num_seqs that would fit (or that the weights alone do not).
  concurrency  sequences at once at --max-model-len and at a typical coding-agent context (AGENT_CONTEXT
            tokens, or --max-model-len if shorter): KV blocks // blocks per sequence.
  host tier  --kv-offloading-size GiB holds GiB // (block_size x kv/token) blocks of evicted prefixes
            (config.host_tier_blocks, as the runner allocates it); this machine's available memory is reported
            beside it (the plan may be for another machine, so it only warns).
CLI: ``add_plan_arguments(parser)`` adds --gpu / --gpu-memory-gib / --json to a parser that already has the
serve flags (``config.add_serve_arguments``, generated from the option table); ``main_plan(argv)`` builds that
parser itself, so every serve flag is accepted, with serve's defaults, and those that do not change memory are
ignored. Exit 0 = fits and
allowed, 1 = does not fit or refused, 2 = bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from onecard.checkpoint_meta import FLOAT_DTYPES, CheckpointMeta, read_checkpoint_meta
from onecard.config import (
    ConfigError,
    DeviceSpec,
    EngineArgs,
    EngineConfig,
    add_serve_arguments,
    create_config,
    host_tier_blocks,
    model_argument,
)
from onecard.dtypes import DTYPE_BYTES
from onecard.env import Env
from onecard.gpus import GPUS, GpuSpec, find_gpu  # noqa: F401 - the plan's cards (re-exported for callers)
from onecard.hardware import decide, host_memory, sm
from onecard.kernels import paths
from onecard.kv_dtype import bytes_per_token, kv_shape
from onecard.kv_dtype import element_bytes as kv_element_bytes
from onecard.kv_dtype import resolve as resolve_kv_dtype

GIB = 2**30
FIXED_OVERHEAD = int(0.75 * GIB)
GROUPED_MOE_MIN_TOKENS = paths.GROUPED_MIN_TOKENS
AGENT_CONTEXT = 32768             # tokens of a typical coding-agent conversation (issue 23)


# The plan takes the engine's own options (the name is kept for callers that spell it so).
PlanSettings = EngineArgs


def engine_args_of(args: Any) -> EngineArgs:
    """``args`` as EngineArgs: itself, or its attributes of EngineArgs' names (defaults for the rest; None: all)."""
    if isinstance(args, EngineArgs):
        return args
    d = EngineArgs()
    values = {f.name: getattr(args, f.name, getattr(d, f.name)) for f in fields(EngineArgs)}
    values["model"] = model_argument(args)                  # MODEL or --model, as serve takes it
    return EngineArgs(**values)


@dataclass(slots=True)
class PlanReport:
    model: str
    architecture: str | None
    gpu: str | None
    compute_capability: str | None
    total_memory_gib: float | None
    gpu_memory_utilization: float
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    weights_bytes: int
    weights_gib: float
    weights_breakdown: dict[str, int]
    kv_bytes_per_token: int
    activation_bytes: int
    activation_breakdown: dict[str, int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    budget_gib: float | None = None
    kv_capacity_bytes: int | None = None
    kv_capacity_gib: float | None = None
    kv_capacity_tokens: int | None = None
    num_blocks: int | None = None
    max_concurrent_at_max_len: int | None = None
    agent_context: int | None = None                  # AGENT_CONTEXT, or --max-model-len if shorter
    max_concurrent_at_agent_context: int | None = None
    kv_offloading_size_gib: float | None = None
    host_tier_blocks: int = 0
    host_tier_tokens: int = 0                          # cached prefix tokens the host tier holds
    host_memory_available_gib: float | None = None     # on the machine running the plan
    fits: bool | None = None
    allowed: bool = True
    refusal: str | None = None
    largest_max_model_len: int | None = None
    activation_bytes_per_position: int = 0            # the part of activation_bytes that grows with --max-model-len
    largest_max_num_seqs: int | None = None
    backends: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.allowed and self.fits is not False

    def verdict(self) -> str:
        memory = {True: "FITS", False: "DOES NOT FIT", None: "memory unknown (no card given)"}[self.fits]
        return memory if self.allowed else f"REFUSED ({memory.lower()})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["verdict"] = self.ok, self.verdict()
        return d

    def render(self) -> str:
        def g(b: int | None) -> str:
            return "-" if b is None else f"{b / GIB:.2f} GiB"
        total = "-" if self.total_memory_gib is None else f"{self.total_memory_gib:.2f} GiB"
        lines = [
            f"model      {self.model} ({self.architecture})",
            (f"card       {self.gpu or 'unknown'} ({self.compute_capability or '?'}), {total}, "
            f"--gpu-memory-utilization {self.gpu_memory_utilization}"),
            f"serving    dtype {self.dtype}, kv cache {self.kv_cache_dtype}, quantization {self.quantization}",
            f"weights    {g(self.weights_bytes)} ({self.weights_bytes / 1e9:.1f} GB)  "
            + ", ".join(f"{k} {g(v)}" for k, v in self.weights_breakdown.items() if v),
            f"activations {g(self.activation_bytes)} at --max-num-batched-tokens {self.max_num_batched_tokens}",
            (f"kv cache   {self.kv_bytes_per_token:,} B/token; {g(self.kv_capacity_bytes)} = "
            f"{self.kv_capacity_tokens if self.kv_capacity_tokens is not None else '-'} tokens"),
            (f"at --max-model-len {self.max_model_len}: "
            f"{'-' if self.max_concurrent_at_max_len is None else self.max_concurrent_at_max_len} sequence(s) at once "
            f"(--max-num-seqs {self.max_num_seqs})"),
        ]
        if self.agent_context is not None and self.max_concurrent_at_agent_context is not None:
            lines.append(f"at a {self.agent_context}-token agent context: {self.max_concurrent_at_agent_context} "
                         "sequence(s) at once")
        here = ("-" if self.host_memory_available_gib is None else f"{self.host_memory_available_gib:.1f} GiB")
        if self.kv_offloading_size_gib:
            lines.append(f"host tier  --kv-offloading-size {self.kv_offloading_size_gib:g} GiB = "
                         f"{self.host_tier_tokens:,} cached prefix tokens ({self.host_tier_blocks:,} blocks); "
                         f"this machine has {here} available")
        else:
            lines.append(f"host tier  off (--kv-offloading-size GiB); this machine has {here} of host memory "
                         "available")
        lines.append(f"verdict    {self.verdict()}")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def weight_bytes(meta: CheckpointMeta, dtype: str, device: str = "cuda") -> tuple[int, dict[str, int]]:
    """Bytes the loader places on the device, with a breakdown (see the module docstring). GPTQ scales go
    to fp16 on CUDA and stay as stored on the CPU (as the loader does)."""
    fb = DTYPE_BYTES.get(dtype, 2)
    keep_g_idx = bool(meta.quant and meta.quant.desc_act)
    out = {"gptq_packed": 0, "gptq_scales": 0, "gptq_g_idx": 0, f"float_{dtype}": 0, "other": 0}
    for t in meta.tensors.values():
        if t.name.endswith("rotary_emb.inv_freq"):
            continue                       # recomputed, never loaded
        if t.name.endswith((".qweight", ".qzeros")):
            out["gptq_packed"] += t.nbytes
        elif t.name.endswith(".scales"):
            out["gptq_scales"] += t.numel * 2 if device == "cuda" else t.nbytes
        elif t.name.endswith(".g_idx"):
            out["gptq_g_idx"] += t.nbytes if keep_g_idx else 0
        elif t.dtype in FLOAT_DTYPES:
            out[f"float_{dtype}"] += t.numel * fb
        else:
            out["other"] += t.nbytes
    return sum(out.values()), out


def activation_bytes(meta: CheckpointMeta, tokens: int, seqs: int, act_bytes: int,
                     cc: tuple[int, int] | None, max_model_len: int = 0, kv_bytes: int = 0) -> tuple[int, dict[str, int]]:
    """Activation bytes of a ``tokens``-token step by part; ``max_model_len`` and ``kv_bytes`` (the KV cache's
    element size) size the prefill attention's SDPA workspace where the card takes that path (below sm80)."""
    c = meta.hf_config
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    _, kv_heads, d = kv_shape(c)
    out = {"hidden": tokens * 4 * h * act_bytes, "attention": tokens * ((heads + 2 * kv_heads) * d + heads * d) * act_bytes}
    experts = int(c.get("num_experts") or 0)
    if experts:
        top_k, inter = int(c.get("num_experts_per_tok", 8)), int(c.get("moe_intermediate_size") or c["intermediate_size"])
        out["moe"] = tokens * top_k * (3 * inter + h) * act_bytes + tokens * experts * 4 + tokens * top_k * 8
    else:
        out["mlp"] = tokens * 3 * int(c.get("intermediate_size", 4 * h)) * act_bytes
    out["logits"] = min(seqs, tokens) * int(c.get("vocab_size", 0)) * 4 * 2
    # the kernel-path table says which prefill GEMMs dequantize for cuBLAS (cc unknown: assume they do)
    cci = paths.as_int(cc)
    if meta.quant is not None and (cci is None or paths.choose_dense_gemm(tokens, cci) == "cublas"):
        # the cuBLAS prefill dequantizes one dense weight at a time; the largest is the scratch.
        biggest = 0
        for t in meta.tensors.values():
            if t.name.endswith(".qweight") and ".experts." not in t.name:
                biggest = max(biggest, t.shape[-2] * 8 * t.shape[-1] * act_bytes)
        out["dequant_scratch"] = biggest
    if experts and meta.quant is not None and paths.choose_moe(tokens, cci or 90) in ("grouped", "per-expert"):
        per_expert = max((t.shape[-2] * 8 * t.shape[-1] for t in meta.tensors.values()
                          if t.name.endswith(".qweight") and ".experts." in t.name), default=0)
        out["expert_dequant_scratch"] = experts * per_expert * act_bytes
    if cci is not None and max_model_len and paths.prefill_sdpa_on(cci):
        out["prefill_attention_sdpa"] = paths.prefill_sdpa_workspace(max_model_len, tokens, heads, kv_heads, d,
                                                                     act_bytes, kv_bytes or act_bytes)
    out["fixed_overhead"] = FIXED_OVERHEAD
    return sum(out.values()), out


def plan_from_meta(meta: CheckpointMeta, settings: EngineArgs, total_memory: int | None,
                   cc: tuple[int, int] | None, gpu_name: str | None = None, model: str | None = None) -> PlanReport:
    """Plan ``settings`` for ``meta`` on a GPU of capability ``cc`` (None: unknown) with ``total_memory`` bytes."""
    config = create_config(settings, meta, DeviceSpec("cuda", cc), Env.read())
    quantization = settings.quantization if settings.quantization not in (None, "auto") else meta.quant_method
    return plan_from_config(meta, config, total_memory, cc, gpu_name, model, quantization)


def plan_from_config(meta: CheckpointMeta, config: EngineConfig, total_memory: int | None,
                     cc: tuple[int, int] | None, gpu_name: str | None = None, model: str | None = None,
                     quantization: str | None = None) -> PlanReport:
    """The arithmetic of the module docstring on a resolved configuration; ``quantization`` as the flag or the
    checkpoint names it (default: the checkpoint's method)."""
    m, cache, sched = config.model, config.cache, config.scheduler
    c = meta.hf_config
    reasons: list[str] = []
    arch = meta.architecture
    quantization = quantization or meta.quant_method
    dtype = m.dtype
    decision = decide(cc, dtype, quantization, cache.kv_cache_dtype)
    refusal = decision.refusal
    arch_why = architecture_problem(arch)
    if arch_why:
        refusal = arch_why if refusal is None else f"{arch_why}; {refusal}"
    if decision.refusal:
        reasons.append(decision.refusal)
    if arch_why:
        reasons.insert(0, arch_why)
    try:
        kv_dt = resolve_kv_dtype(cache.kv_cache_dtype, dtype)
    except ValueError:
        kv_dt = dtype                                   # the decision above names the unknown value
    max_pos = int(c.get("max_position_embeddings", 4096))
    tokens = sched.max_num_batched_tokens
    w_total, w_parts = weight_bytes(meta, dtype)
    try:
        kv_tok = bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, kv_dt)
        a_total, a_parts = activation_bytes(meta, tokens, sched.max_num_seqs, DTYPE_BYTES.get(dtype, 2), cc,
                                            sched.max_model_len, kv_element_bytes(kv_dt))
        per_position = (paths.prefill_sdpa_workspace(1, 0, 0, m.num_kv_heads, m.head_dim, DTYPE_BYTES.get(dtype, 2),
                                                     kv_element_bytes(kv_dt))
                        if "prefill_attention_sdpa" in a_parts else 0)
    except KeyError as e:
        raise ConfigError(f"{meta.path / 'config.json'} lacks {e.args[0]!r}; cannot size the KV cache "
                          + (f"({refusal})" if refusal else "(not a decoder-only LLM config?)")) from None
    r = PlanReport(
        model=model or str(meta.path), architecture=arch, gpu=gpu_name,
        compute_capability=None if cc is None else sm(cc),
        total_memory_gib=None if total_memory is None else total_memory / GIB,
        gpu_memory_utilization=cache.gpu_memory_utilization, dtype=dtype, kv_cache_dtype=kv_dt,
        quantization=quantization, weights_bytes=w_total, weights_gib=w_total / GIB, weights_breakdown=w_parts,
        kv_bytes_per_token=kv_tok, activation_bytes=a_total, activation_breakdown=a_parts,
        activation_bytes_per_position=per_position,
        max_model_len=m.max_model_len, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=tokens,
        block_size=cache.block_size, allowed=refusal is None, refusal=refusal, backends=decision.backends,
        reasons=reasons)
    _host_tier(r, cache.kv_offloading_size)
    if total_memory is None:
        reasons.append("no card given and no GPU here: pass --gpu NAME or --gpu-memory-gib N for the KV capacity.")
        return r
    _fit(r, total_memory, max_pos, int(c.get("vocab_size", 0)), cache.kv_cache_memory_bytes)
    return r


def _host_tier(r: PlanReport, size_gib: float | None) -> None:
    mem = host_memory()
    r.host_memory_available_gib = None if mem is None else mem.available_gib
    if not size_gib:
        return
    r.kv_offloading_size_gib = float(size_gib)
    r.host_tier_blocks = host_tier_blocks(size_gib, r.block_size * r.kv_bytes_per_token)
    r.host_tier_tokens = r.host_tier_blocks * r.block_size
    if mem is not None and size_gib * GIB > mem.available_bytes:
        r.reasons.append(f"note: --kv-offloading-size={size_gib:g} GiB is more than this machine's available "
                         f"host memory ({mem.available_gib:.1f} GiB); the serving machine needs that much free.")


def _fit(r: PlanReport, total_memory: int, max_pos: int, vocab: int, kv_override: int | None) -> None:
    budget = int(total_memory * r.gpu_memory_utilization)
    r.budget_gib = budget / GIB
    block_bytes = r.block_size * r.kv_bytes_per_token
    blocks_per_seq = math.ceil(r.max_model_len / r.block_size)
    free_for_kv = budget - r.weights_bytes - r.activation_bytes
    # --kv-cache-memory-bytes replaces the utilization-based sizing (as in vLLM).
    kv = max(0, free_for_kv if kv_override is None else min(kv_override, total_memory - budget + free_for_kv))
    r.kv_capacity_bytes = kv
    r.kv_capacity_gib = kv / GIB
    r.num_blocks = kv // block_bytes
    r.kv_capacity_tokens = r.num_blocks * r.block_size
    r.max_concurrent_at_max_len = r.num_blocks // blocks_per_seq
    r.agent_context = min(AGENT_CONTEXT, r.max_model_len)
    r.max_concurrent_at_agent_context = r.num_blocks // math.ceil(r.agent_context / r.block_size)
    where = f"{r.gpu or 'the card'} ({total_memory / GIB:.2f} GiB x {r.gpu_memory_utilization} = {budget / GIB:.2f} GiB)"
    if r.weights_bytes + r.activation_bytes > budget:
        r.fits = False
        need = (r.weights_bytes + r.activation_bytes + blocks_per_seq * block_bytes) / r.gpu_memory_utilization
        r.reasons.append(
            f"does not fit: weights {r.weights_gib:.2f} GiB ({r.weights_bytes / 1e9:.1f} GB) + activations "
            f"{r.activation_bytes / GIB:.2f} GiB exceed the budget of {where}; one {r.max_model_len}-token "
            f"sequence needs a card with at least {need / GIB:.1f} GiB (or a 4-bit GPTQ checkpoint).")
        return
    # the longest sequence whose KV fits beside the activations at that length (the SDPA gather grows with it)
    free_at_zero = free_for_kv + r.activation_bytes_per_position * r.max_model_len
    longest = free_at_zero // (r.kv_bytes_per_token + r.activation_bytes_per_position) // r.block_size * r.block_size
    longest = min(longest, r.kv_capacity_tokens) if kv_override is not None else longest
    r.largest_max_model_len = min(longest, max_pos) if longest > 0 else None
    # Largest --max-num-seqs: the sampler's logits rows are the only activation term that grows with it.
    per_seq = vocab * 4 * 2
    spare = free_for_kv - blocks_per_seq * block_bytes + min(r.max_num_seqs, r.max_num_batched_tokens) * per_seq
    r.largest_max_num_seqs = max(0, spare // per_seq) if per_seq else None
    if r.max_concurrent_at_max_len >= 1:
        r.fits = True
        r.reasons.append(
            f"fits: KV cache {r.kv_capacity_gib:.2f} GiB = {r.kv_capacity_tokens:,} tokens; "
            f"{r.max_concurrent_at_max_len} sequence(s) of {r.max_model_len} tokens at once, and "
            f"{r.max_num_seqs} sequences of up to {r.kv_capacity_tokens // max(1, r.max_num_seqs):,} tokens each.")
        return
    r.fits = False
    largest = (f"the largest --max-model-len that fits is {r.largest_max_model_len}"
               if r.largest_max_model_len else "not even one KV block fits")
    seqs = (f"; --max-num-seqs up to {r.largest_max_num_seqs} would leave room for one {r.max_model_len}-token "
            "sequence" if r.largest_max_num_seqs else "")
    r.reasons.append(
        f"does not fit: one {r.max_model_len}-token sequence needs {blocks_per_seq * block_bytes / GIB:.2f} GiB "
        f"of KV cache but only {r.kv_capacity_gib:.2f} GiB ({r.kv_capacity_tokens:,} tokens) is left on {where} "
        f"after weights {r.weights_gib:.2f} GiB and activations {r.activation_bytes / GIB:.2f} GiB; {largest}{seqs}.")


def architecture_problem(arch: str | None) -> str | None:
    """None when onecard implements ``arch``; else the reason, naming it."""
    from onecard.models.registry import MODELS, NOT_SUPPORTED

    if arch in MODELS:
        return None
    if arch is None:
        return "config.json names no `architectures`; cannot pick a model class."
    why = NOT_SUPPORTED.get(arch, "onecard has no implementation of it")
    return f"architecture {arch} cannot be served: {why}. Supported: {', '.join(sorted(MODELS))}."


def local_gpu() -> tuple[str, int, tuple[int, int]] | None:
    """(name, total bytes, cc) of GPU 0 through NVML (no CUDA context), or None without a usable GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from onecard.gpu_query import query_gpu
        from onecard.kernels import paths

        info = query_gpu()                                                # NVML: no CUDA context here
        emulated = paths.emulated_capability()                            # ONECARD_EMULATE_CC honoured
        cc = info.cc if emulated is None else (emulated // 10, emulated % 10)
        return info.name, info.total_memory, cc
    except Exception:  # noqa: BLE001 - no usable GPU is an answer, not an error
        return None


def checkpoint_meta_for(model: str, revision: str | None = None, download_dir: str | None = None) -> CheckpointMeta:
    """A local directory or cached snapshot is read from disk; a hub id only the hub has, from its metadata
    (config.json, quantization config, safetensors headers by ranged reads): nothing is downloaded."""
    from onecard.hub.download import parse_hub_id, remote_checkpoint_meta
    from onecard.hub.resolve import cached_model

    env = Env.read()
    local = cached_model(model, env, revision, download_dir)
    if local is not None:
        return read_checkpoint_meta(local)
    return remote_checkpoint_meta(*parse_hub_id(model, revision), env)


def plan(model: str, args: Any = None, gpu_memory_gib: float | None = None, gpu_name: str | None = None) -> PlanReport:
    settings = engine_args_of(args)
    meta = checkpoint_meta_for(model, getattr(args, "revision", None), getattr(args, "download_dir", None))
    cc: tuple[int, int] | None = None
    total: int | None = None
    name: str | None = None
    if gpu_name is not None:
        spec = find_gpu(gpu_name)
        name, cc, total = spec.name, spec.cc, int(spec.memory_gib * GIB)
    local = local_gpu() if gpu_name is None else None
    if local is not None:
        name, total, cc = local
    if gpu_memory_gib is not None:
        total = int(gpu_memory_gib * GIB)
        name = f"{gpu_memory_gib:g} GiB card" + (f" ({name})" if name else "")
    report = plan_from_meta(meta, settings, total, cc, name, model)
    if cc is None:
        report.backends = {}           # a GPU plan without a known card: no backend choice to report
    if cc is None and total is not None:
        report.reasons.append("compute capability unknown (--gpu-memory-gib only): dtype checks assume a GPU "
                              "with fp16; pass --gpu NAME for the capability checks.")
    return report


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("plan")
    card = g.add_mutually_exclusive_group()
    card.add_argument("--gpu-memory-gib", type=float, default=None, help="plan for a card with N GiB")
    card.add_argument("--gpu", default=None, metavar="NAME", help="plan for a known card: " + ", ".join(GPUS))
    g.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def build_plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onecard plan", description=
                                     "Memory plan from checkpoint metadata (no weights are read).")
    add_serve_arguments(parser)
    return add_plan_arguments(parser)


def main_plan(argv: list[str]) -> int:
    ns = build_plan_parser().parse_args(argv)
    try:
        model = model_argument(ns)
        if model is None:
            from onecard.hub.resolve import default_model_path

            model = str(default_model_path())
        report = plan(model, ns, ns.gpu_memory_gib, ns.gpu)
    except ConfigError as e:
        print(f"onecard plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if ns.json else report.render())
    return 0 if report.ok else 1
