"""The option table and the configuration it resolves to.

Contract:
  ``EngineArgs`` (vLLM's engine-argument names) and ``ServerConfig`` (the API server's options) declare every
  option once: field name, flag spelling(s), type, default, help (``onecard.options.option``). ``serve``'s and
  ``plan``'s argparse (``add_serve_arguments``) and the namespace -> options step (``EngineArgs.from_namespace``,
  ``ServerConfig.from_namespace``) are generated from those fields; ``LLM(**kwargs)`` fills ``EngineArgs``.
  ``create_config(args, meta, device, env) -> EngineConfig`` is a pure function of the options, the checkpoint's
  metadata (``CheckpointMeta``: config.json, generation config, quantization config) and the device
  (``DeviceSpec``: cuda or cpu, and the compute capability when it matters); serve, ``LLM`` and ``plan`` all
  call it, so they cannot disagree. ``EngineArgs.create_config()`` gathers those inputs (checks the options,
  resolves the model: local, cached or downloaded; reads the metadata, no tensor data; finds the device) and
  calls it. Every error is a ``ConfigError`` naming the option, the value and what would work.
  The defaults derived from other options live here once: ``default_max_num_batched_tokens``,
  ``default_max_num_queued_reqs``, ``default_engine_threads``, ``default_api_threads``; the dtype rule is
  ``onecard.dtypes.serving_dtype``, the KV bytes per token ``onecard.kv_dtype.bytes_per_token``.
  ``Env`` (the only reader of the environment) and ``ConfigError`` live in ``onecard.env``; the checkpoint
  readers in ``onecard.checkpoint_meta``; both are re-exported here.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onecard.checkpoint_meta import (  # noqa: F401 - re-exported: the checkpoint readers' old home
    CheckpointMeta,
    QuantConfig,
    read_checkpoint_meta,
    read_json,
    read_quant_config,
    read_raw_quant_config,
)
from onecard.dtypes import needs_capability, normalize_dtype, serving_dtype
from onecard.env import ConfigError, Env
from onecard.gpu_query import query_gpu
from onecard.hardware import host_memory, host_tier_refusal
from onecard.hub.resolve import DEFAULT_MODEL_NAME, default_model_path, resolve_model
from onecard.kernels import paths
from onecard.kv_dtype import KV_CACHE_DTYPES, kv_shape
from onecard.options import add_arguments, fraction, human_int, option, values_from

__all__ = ["CacheConfig", "ConfigError", "DeviceSpec", "EngineArgs", "EngineConfig", "Env", "ModelConfig",
           "QuantConfig", "SchedulerConfig", "ServerConfig", "add_serve_arguments", "create_config"]


# ---------------------------------------------------------------- defaults derived from other options (one home)
def default_engine_threads(device: str, cpu_count: int) -> int:
    """Torch intra-op threads for the engine: 1 on a GPU (the host only launches kernels; vLLM sets
    OMP_NUM_THREADS=1 for the same reason), half the CPUs on the CPU path (measured on a busy 2-core box: a
    20-token chat took 2.7-98 s with torch's default of every core, 0.45 s with one thread)."""
    return 1 if device == "cuda" else max(1, cpu_count // 2)


def default_api_threads(cpu_count: int) -> int:
    """Threads that template and tokenize requests off the event loop (the GIL bounds their use)."""
    return max(1, min(4, cpu_count))


# Requests allowed to wait per --max-num-seqs slot when --max-num-queued-reqs is not given (documented in
# README): beyond it new requests get 503 + Retry-After at once instead of minutes of queueing.
DEFAULT_QUEUED_REQS_PER_SEQ = 4
MIN_DEFAULT_QUEUED_REQS = 64
# --max-request-body-bytes when not given (README): bodies beyond it get 413 before they are read.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# --max-num-batched-tokens when not given: vLLM's 8192 with chunked prefill; without it a whole prompt of
# --max-model-len must fit one step (and at least 2048).
DEFAULT_BATCHED_TOKENS_CHUNKED = 8192
MIN_BATCHED_TOKENS_UNCHUNKED = 2048


def default_max_num_queued_reqs(max_num_seqs: int) -> int:
    return max(MIN_DEFAULT_QUEUED_REQS, DEFAULT_QUEUED_REQS_PER_SEQ * max_num_seqs)


def default_max_num_batched_tokens(enable_chunked_prefill: bool, max_model_len: int) -> int:
    if enable_chunked_prefill:
        return DEFAULT_BATCHED_TOKENS_CHUNKED
    return max(max_model_len, MIN_BATCHED_TOKENS_UNCHUNKED)


def host_tier_blocks(kv_offloading_size_gib: float | None, block_bytes: int) -> int:
    """KV blocks a host tier of ``--kv-offloading-size`` GiB holds (the runner allocates it, the plan reports it)."""
    if not kv_offloading_size_gib or block_bytes <= 0:
        return 0
    return int(kv_offloading_size_gib * 2**30) // block_bytes


# ---------------------------------------------------------------- the resolved configuration
@dataclass(slots=True)
class ModelConfig:
    model: str                     # as given (hub id or path): the `root` of /v1/models cards
    path: Path                     # resolved local directory
    hf_config: dict[str, Any]      # config.json
    architecture: str
    dtype: str                     # "float16" | "bfloat16" | "float32"
    quant: QuantConfig | None
    max_model_len: int
    seed: int
    tokenizer: str                 # path of the tokenizer (defaults to `path`)
    chat_template: str | None = None
    served_model_names: list[str] = field(default_factory=list)
    generation_config: dict[str, Any] = field(default_factory=dict)

    # Shapes used by the KV cache and the planner (kv_dtype.kv_shape reads them from config.json).
    @property
    def num_layers(self) -> int:
        return kv_shape(self.hf_config)[0]

    @property
    def num_kv_heads(self) -> int:
        return kv_shape(self.hf_config)[1]

    @property
    def head_dim(self) -> int:
        return kv_shape(self.hf_config)[2]

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.generation_config.get("eos_token_id", self.hf_config.get("eos_token_id"))
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"               # as given (vLLM's names); kv_dtype.resolve() -> stored format
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None   # overrides the profiled size
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None          # set by the runner after profiling (or tests)
    kv_offloading_size: float | None = None    # GiB of host memory for evicted prefix blocks (None = off)
    kv_offloading_backend: str = "native"


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS_CHUNKED
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    max_num_queued_reqs: int | None = None     # None = unbounded
    async_scheduling: bool = False             # schedule step n+1 while step n runs (engine_core.py)


# vLLM methods that need a draft model or draft heads (onecard runs the model-free ones: ngram, suffix).
_SPEC_NEEDS_MODEL = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp",
                     "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(slots=True)
class SpeculativeConfig:
    """``--speculative-config`` / ``LLM(speculative_config=...)``, vLLM's keys: ``method`` ("ngram" | "suffix"),
    ``num_speculative_tokens`` (k, the most drafts verified per sequence and step; suffix: defaults to its tree
    depth), ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram) and ``suffix_decoding_*`` (suffix); the
    method's keys pass through to ``make_drafter`` (core/spec/drafter.py, which checks their values) as
    ``params``. Methods that need a draft model or heads (eagle, mtp, ...) are refused. With
    ``--async-scheduling`` the engine loop is hybrid (core/engine_core.py): plain steps pipeline, a step with
    drafts is resolved before the next is scheduled."""

    method: str
    num_speculative_tokens: int
    params: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def parse(value: str | dict | None) -> SpeculativeConfig | None:
        """The JSON text (CLI) or dict (``LLM``) checked; None (off) for None / "" / {}."""
        from onecard.core.spec.drafter import DRAFTER_PARAMS, SUFFIX_DEFAULTS, make_drafter

        flag = "--speculative-config"
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} is not valid JSON ({e}); e.g. "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'.') from None
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}.")
        methods = ", ".join(DRAFTER_PARAMS)
        method = value.get("method")
        if method is None:
            raise ConfigError(f'{flag} needs "method": one of {methods}.')
        method = str(method).lower()
        if method not in DRAFTER_PARAMS:
            why = (" (it needs a draft model or draft heads, which onecard does not run)"
                   if method in _SPEC_NEEDS_MODEL else "")
            raise ConfigError(f"{flag} method {method!r} is not supported{why}; use one of {methods}.")
        known = ("method", "num_speculative_tokens", *DRAFTER_PARAMS[method])
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ConfigError(f"{flag} key(s) {sorted(unknown)} are unknown or do not apply to method {method!r}; "
                              f"it reads {', '.join(known)}.")
        k = value.get("num_speculative_tokens")
        if k is None and method == "suffix":
            k = int(value.get("suffix_decoding_max_tree_depth", SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{flag} num_speculative_tokens={k!r} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}.")
        params = {n: v for n, v in value.items() if n in DRAFTER_PARAMS[method]}
        try:
            make_drafter(method, k, **params)           # the drafter checks its own keys' values
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{flag}: {e}.") from None
        return SpeculativeConfig(method=method, num_speculative_tokens=k, params=params)


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str                    # "cuda" | "cpu"
    enforce_eager: bool
    env: Env
    engine_threads: int = 1        # torch intra-op threads in the engine (see default_engine_threads)
    speculative: SpeculativeConfig | None = None   # None = no speculative decoding


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """The device a configuration is for: ``kind`` "cuda" | "cpu"; ``cc`` the compute capability, (7, 0) for a
    V100, or None where unknown or not needed (only the bf16 -> fp16 fallback of ``--dtype auto`` reads it)."""

    kind: str
    cc: tuple[int, int] | None = None


# ---------------------------------------------------------------- the option table: engine (vLLM names)
_M, _KV, _S, _P, _R = "model", "KV cache", "scheduler", "parallelism (one GPU)", "runtime"


@dataclass(slots=True)
class EngineArgs:
    model: str | None = option(None, "--model", group=_M,
                               help="same as the positional MODEL (as the deployment writes it)")
    served_model_name: list[str] | None = option(  # noqa: RUF009 - None default; option() is a field()
        None, "--served-model-name", group=_M, metavar="NAME",
        help="names clients may use in `model` (default: the model argument); all are accepted")
    revision: str | None = option(None, "--revision", group=_M,
                                  help="hub branch, tag or commit of the model (default: main; also ORG/NAME@REVISION)")
    download_dir: str | None = option(
        None, "--download-dir", group=_M,
        help="hub cache folder to look in and download into (default: HF_HUB_CACHE or HF_HOME/hub)")
    tokenizer: str | None = option(None, "--tokenizer", group=_M, help="tokenizer directory (default: the model's)")
    dtype: str = option("auto", "--dtype", group=_M, help="auto, float16, bfloat16 or float32 (GPTQ runs float16)")
    quantization: str | None = option(None, "--quantization", "-q", group=_M,
                                      help="gptq (read from the checkpoint when omitted)")
    max_model_len: int | None = option(None, "--max-model-len", group=_M, type=human_int,
                                       help="context length, prompt + output (e.g. 65536 or 64k; default: the model's)")
    seed: int = option(0, "--seed", group=_M, help="random seed")
    chat_template: str | None = option(None, "--chat-template", group=_M,
                                       help="a chat template file, or the template text")
    trust_remote_code: bool = option(False, "--trust-remote-code", group=_M,
                                     help="accepted for compatibility; no effect")

    kv_cache_dtype: str = option(
        "auto", "--kv-cache-dtype", group=_KV,
        help="auto (the serving dtype); fp8_e5m2: 1 byte per element, half the KV bytes, every card (sm70+); "
             "fp8 = fp8_e4m3: 1 byte, sm89+, per-layer k/v scales from the checkpoint (else 1.0)")
    block_size: int = option(16, "--block-size", group=_KV, help="tokens per KV block: 8, 16, 32, 64 or 128")
    gpu_memory_utilization: float = option(
        0.9, "--gpu-memory-utilization", group=_KV, type=fraction,
        help="fraction of GPU memory for weights + activations + KV cache (0, 1]")
    kv_cache_memory_bytes: int | None = option(
        None, "--kv-cache-memory-bytes", group=_KV, type=human_int,
        help="KV cache size in bytes (e.g. 8G); overrides --gpu-memory-utilization's sizing")
    enable_prefix_caching: bool = option(True, "--enable-prefix-caching", group=_KV, negatable=True,
                                         help="reuse KV blocks of shared prompt prefixes (default on)")
    num_gpu_blocks_override: int | None = option(None, "--num-gpu-blocks-override", group=_KV,
                                                 help="testing: a fixed KV block count")
    kv_offloading_size: float | None = option(
        None, "--kv-offloading-size", "--kv-offload-gib", group=_KV, type=fraction, metavar="GIB",
        help="GiB of host memory that keeps prefix blocks the GPU cache evicts, copied back on a hit instead of "
             "recomputed (default off)")
    kv_offloading_backend: str = option("native", "--kv-offloading-backend", group=_KV, choices=["native", "lmcache"],
                                        help="host tier implementation: native (onecard's; lmcache is not supported)")

    max_num_seqs: int = option(256, "--max-num-seqs", group=_S, help="maximum concurrent sequences per step")
    max_num_batched_tokens: int | None = option(
        None, "--max-num-batched-tokens", group=_S, type=human_int,
        help=f"token budget per step (default {DEFAULT_BATCHED_TOKENS_CHUNKED} with chunked prefill)")
    long_prefill_token_threshold: int = option(
        0, "--long-prefill-token-threshold", group=_S, type=human_int,
        help="cap on one request's new tokens per step while others run (0 = off)")
    enable_chunked_prefill: bool = option(True, "--enable-chunked-prefill", group=_S, negatable=True,
                                          help="split long prompts across steps (default on)")
    max_num_queued_reqs: int | None = option(
        None, "--max-num-queued-reqs", group=_S,
        help=f"waiting requests beyond which new ones get 503 + Retry-After at once (default: "
             f"{DEFAULT_QUEUED_REQS_PER_SEQ} x --max-num-seqs, at least {MIN_DEFAULT_QUEUED_REQS})")
    async_scheduling: bool | None = option(
        None, "--async-scheduling", group=_S, negatable=True,
        help="schedule the next step while the GPU runs this one (hides host time; default: on with a GPU, "
             "off on the CPU path; with --speculative-config, verify steps still run one at a time; see "
             "default_async_scheduling)")
    speculative_config: str | dict | None = option(  # noqa: RUF009 - None default; option() is a field()
        None, "--speculative-config", group=_S, metavar="JSON",
        help='speculative decoding (default off): {"method": "ngram"|"suffix", "num_speculative_tokens": K, '
             '"prompt_lookup_min": N, "prompt_lookup_max": N, "suffix_decoding_...": ...}')

    tensor_parallel_size: int = option(1, "--tensor-parallel-size", "-tp", group=_P, help="must be 1")
    pipeline_parallel_size: int = option(1, "--pipeline-parallel-size", "-pp", group=_P, help="must be 1")

    enforce_eager: bool = option(False, "--enforce-eager", group=_R, help="no CUDA graphs")
    engine_threads: int | None = option(
        None, "--engine-threads", group=_R,
        help="torch CPU threads in the engine process (default: ONECARD_ENGINE_THREADS, else 1 on a GPU and half "
             "the CPUs on the CPU path)")
    device: str = option("auto", "--device", group=_R, choices=["auto", "cuda", "cpu"])

    @staticmethod
    def from_namespace(ns: argparse.Namespace) -> EngineArgs:
        """Parsed ``add_serve_arguments`` flags -> EngineArgs (MODEL or --model, which must agree)."""
        values = values_from(EngineArgs, ns)
        values["model"] = model_argument(ns)
        return EngineArgs(**values)

    def validate(self) -> None:
        """The checks that need no checkpoint and no device (run before a model is resolved or downloaded)."""
        for name, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if value != 1:
                raise ConfigError(f"{name}={value} is not supported: onecard serves one model on one GPU. "
                                  f"Use {name}=1.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization={self.gpu_memory_utilization} must be in (0, 1].")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"--block-size={self.block_size} is not supported; use 8, 16, 32, 64 or 128.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype={self.kv_cache_dtype} is unknown; use one of "
                              f"{', '.join(KV_CACHE_DTYPES)}.")
        self._check_offloading()
        SpeculativeConfig.parse(self.speculative_config)          # a bad JSON or key fails before any download
        if self.quantization not in (None, "gptq", "gptq_marlin", "auto"):
            raise ConfigError(f"--quantization={self.quantization} is not supported; onecard runs gptq (4-bit).")
        if self.dtype != "auto" and normalize_dtype(self.dtype) is None:
            raise ConfigError(f"--dtype={self.dtype} is unknown; use auto, float16, bfloat16 or float32.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs={self.max_num_seqs} must be at least 1.")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold={self.long_prefill_token_threshold} must be >= 0.")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ConfigError(f"--max-num-queued-reqs={self.max_num_queued_reqs} must be >= 0.")
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ConfigError(f"--engine-threads={self.engine_threads} must be at least 1.")

    def _check_offloading(self) -> None:
        size = self.kv_offloading_size
        if self.kv_offloading_backend != "native":
            raise ConfigError(f"--kv-offloading-backend={self.kv_offloading_backend} is not supported; onecard has "
                              "its own host tier: use --kv-offloading-backend=native.")
        if size is None:
            return
        if not size > 0:
            raise ConfigError(f"--kv-offloading-size={size:g} must be a positive number of GiB (omit it for no "
                              "host tier).")
        if not self.enable_prefix_caching:
            raise ConfigError(f"--kv-offloading-size={size:g} keeps evicted prefix-cache blocks in host memory; it "
                              "needs prefix caching: drop --no-enable-prefix-caching.")

    def create_config(self) -> EngineConfig:
        """Check the options, then gather the inputs of ``create_config`` from this machine and call it."""
        env = Env.read()
        self.validate()
        if self.kv_offloading_size is not None:   # this machine's memory, before any weight loads
            why = host_tier_refusal(int(self.kv_offloading_size * 2**30), host_memory())
            if why is not None:
                raise ConfigError(why)
        path = default_model_path() if self.model is None else \
            resolve_model(self.model, env, self.revision, self.download_dir)
        meta = read_checkpoint_meta(path, with_tensors=False)
        if meta.quant_method not in (None, "gptq"):
            read_quant_config(path, meta.hf_config)         # raises, naming the method onecard does not run
        kind = detect_device(self.device)
        cc = card_capability(self.dtype, meta.hf_config, meta.quant is not None, kind, env)
        return create_config(self, meta, DeviceSpec(kind, cc), env)

    def _resolve_dtype(self, hf_config: dict, quant: QuantConfig | None, device: str) -> str:
        """The serving dtype on this machine's ``device`` (asks the card only when the rule needs it)."""
        cc = card_capability(self.dtype, hf_config, quant is not None, device, Env.read())
        return serving_dtype(self.dtype, hf_config, quant is not None, device, cc)


def detect_device(requested: str) -> str:
    """--device auto -> "cuda" when torch sees a GPU, else "cpu"."""
    if requested != "auto":
        return requested
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def card_capability(dtype: str, hf_config: dict[str, Any], quantized: bool, device: str,
                    env: Env) -> tuple[int, int] | None:
    """GPU 0's capability (ONECARD_EMULATE_CC honoured) when the dtype rule depends on it, else None. NVML:
    this (the API) process creates no CUDA context."""
    if not needs_capability(dtype, hf_config, quantized, device):
        return None
    emulated = paths.emulated_capability()
    if emulated is not None:
        return emulated // 10, emulated % 10
    return query_gpu(env).cc


def default_async_scheduling(asked: bool | None, device_kind: str) -> bool:
    """``--async-scheduling`` / ``--no-async-scheduling`` as given; unset: on with a GPU (as in vLLM >= 0.14), off
    on the CPU path (its forward runs on the host thread, so there is no device time to hide host work behind).
    With speculative decoding too: the loop is then hybrid (core/engine_core.py), plain steps pipelined and
    verify steps synchronous, so traffic that drafts nothing keeps the async gain.
    Measured (BENCHMARKS.md, H100 80GB HBM3, 2026-12-06, bench/async_ab.py, without speculation): the same greedy
    tokens, decode +5.8% at batch 1 and +4.4% at batch 16."""
    if asked is not None:
        return asked
    return device_kind == "cuda"


def create_config(args: EngineArgs, meta: CheckpointMeta, device: DeviceSpec, env: Env) -> EngineConfig:
    """The configuration ``args`` give for this checkpoint on this device: a pure function (no I/O), shared by
    serve, ``LLM`` and ``plan``. Raises ``ConfigError`` naming the option."""
    args.validate()
    hf_config = meta.hf_config
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ConfigError(f"{meta.path / 'config.json'} names no `architectures`; cannot pick a model class.")
    if args.quantization in ("gptq", "gptq_marlin") and meta.quant is None:
        raise ConfigError(f"--quantization={args.quantization} but {meta.path} has no GPTQ quantization config.")
    dtype = serving_dtype(args.dtype, hf_config, meta.quant is not None, device.kind, device.cc)

    max_len_cfg = int(hf_config.get("max_position_embeddings", 4096))
    max_model_len = args.max_model_len or max_len_cfg
    if args.max_model_len and args.max_model_len > max_len_cfg and not hf_config.get("rope_scaling"):
        raise ConfigError(
            f"--max-model-len={args.max_model_len} is larger than the model's max_position_embeddings "
            f"({max_len_cfg}); use --max-model-len<={max_len_cfg}.")
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = default_max_num_batched_tokens(args.enable_chunked_prefill, max_model_len)
    if not args.enable_chunked_prefill and batched < max_model_len:
        raise ConfigError(
            f"--max-num-batched-tokens={batched} is smaller than --max-model-len={max_model_len} with "
            "chunked prefill disabled; raise it or pass --enable-chunked-prefill.")
    queued = args.max_num_queued_reqs
    if queued is None:
        queued = default_max_num_queued_reqs(args.max_num_seqs)
    threads = args.engine_threads or env.engine_threads or default_engine_threads(device.kind, env.cpu_count)

    if args.model is None:
        given, names = DEFAULT_MODEL_NAME, args.served_model_name or [DEFAULT_MODEL_NAME]
    else:
        given, names = args.model, args.served_model_name or [args.model.split("@")[0]]
    model = ModelConfig(
        model=given, path=Path(meta.path), hf_config=hf_config, architecture=archs[0], dtype=dtype,
        quant=meta.quant, max_model_len=max_model_len, seed=args.seed, tokenizer=args.tokenizer or str(meta.path),
        chat_template=args.chat_template, served_model_names=list(names),
        generation_config=dict(meta.generation_config))
    cache = CacheConfig(
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=args.enable_prefix_caching, num_gpu_blocks=args.num_gpu_blocks_override,
        kv_offloading_size=args.kv_offloading_size, kv_offloading_backend=args.kv_offloading_backend)
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill, max_num_queued_reqs=queued,
        async_scheduling=default_async_scheduling(args.async_scheduling, device.kind))
    return EngineConfig(model=model, cache=cache, scheduler=sched, device=device.kind,
                        enforce_eager=args.enforce_eager, env=env, engine_threads=threads,
                        speculative=SpeculativeConfig.parse(args.speculative_config))


# ---------------------------------------------------------------- the option table: the API server
_O = "OpenAI server"


class ServeArgsError(ConfigError):
    """A serve flag that cannot work (names the flag)."""


@dataclass(slots=True)
class ServerConfig:
    host: str | None = option(None, "--host", group=_O, help="bind address (default: all interfaces)")
    port: int = option(8000, "--port", group=_O, help="port (default 8000)")
    api_key: str | None = option(None, "--api-key", group=_O, help="require `Authorization: Bearer KEY` on /v1/*")
    reasoning_parser: str | None = option(None, "--reasoning-parser", group=_O,
                                          help="split <think> reasoning out: qwen3")
    enable_auto_tool_choice: bool = option(False, "--enable-auto-tool-choice", group=_O,
                                           help="allow tool_choice=auto (needs --tool-call-parser)")
    tool_call_parser: str | None = option(None, "--tool-call-parser", group=_O,
                                          help="tool-call format: hermes or qwen3_coder")
    structured_outputs_config: str | None = option(
        None, "--structured-outputs-config", group=_O, metavar="JSON",
        help='structured outputs: {"backend": "auto"|"xgrammar", "disable_any_whitespace": bool, '
             '"disable_additional_properties": bool, "max_whitespace": N}')
    guided_decoding_backend: str | None = option(
        None, "--guided-decoding-backend", group=_O,
        help="structured outputs backend (vLLM's older flag): auto or xgrammar")
    uvicorn_log_level: str = option("info", "--uvicorn-log-level", group=_O,
                                    choices=["debug", "info", "warning", "error", "critical", "trace"])
    shutdown_timeout: float = option(30.0, "--shutdown-timeout", group=_O,
                                     help="seconds to let in-flight requests finish on SIGTERM")
    disable_log_requests: bool = option(False, "--disable-log-requests", group=_O,
                                        help="no access-log line per request")
    disable_log_stats: bool = option(False, "--disable-log-stats", group=_O,
                                     help="no periodic throughput line (every 10 s while busy)")
    max_request_body_bytes: int = option(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "--max-request-body-bytes", group=_O, type=human_int,
        help="larger request bodies get 413 before they are read (default 8Mi; e.g. 16M)")
    api_threads: int | None = option(
        None, "--api-threads", group=_O,
        help="threads that template and tokenize requests off the event loop (default: ONECARD_API_THREADS, "
             "else min(4, CPUs))")
    single_process: bool = option(False, "--single-process", group=_R,
                                  help="run the engine core in a thread of the server process (tests, debugging)")

    @staticmethod
    def from_namespace(ns: argparse.Namespace) -> ServerConfig:
        return ServerConfig(**values_from(ServerConfig, ns))

    def validate(self) -> None:
        """The server options' own checks (parser names are checked against their registries by the CLI)."""
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ServeArgsError("--enable-auto-tool-choice requires --tool-call-parser (hermes or qwen3_coder).")
        for flag, value in (("--api-threads", self.api_threads),
                            ("--max-request-body-bytes", self.max_request_body_bytes)):
            if value is not None and value < 1:
                raise ServeArgsError(f"{flag}={value} must be at least 1.")
        if not 0 < self.port < 65536:
            raise ServeArgsError(f"--port={self.port} must be in 1..65535.")


# ---------------------------------------------------------------- argparse, generated from the table
def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every ``serve`` flag (the positional MODEL, EngineArgs, ServerConfig) on any parser: ``serve`` and
    ``plan`` both build theirs with it."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory or hub id ORG/NAME[@REVISION]: the HF cache first, else downloaded "
                             "(default: the bundled tiny coder)")
    return add_arguments(parser, EngineArgs, ServerConfig)


def model_argument(ns: argparse.Namespace) -> str | None:
    """MODEL or --model (as the deployment writes it); both given, they must agree."""
    tag, flag = getattr(ns, "model_tag", None), getattr(ns, "model", None)
    if tag and flag and tag != flag:
        raise ServeArgsError(f"MODEL={tag!r} and --model={flag!r} disagree; give one of them.")
    return flag or tag

