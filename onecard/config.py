"""Configuration dataclasses and the one place that reads the environment.

Contract: ``EngineArgs`` carries vLLM's engine-argument names (the CLI and ``LLM(**kwargs)`` both fill it);
``EngineArgs.create_config()`` resolves the model, reads config.json / quantization config (metadata only,
no tensor data), validates every option and returns an ``EngineConfig``. Every error is a ``ConfigError``
naming the option, the value and what would work. No other module reads ``os.environ``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onecard.kv_dtype import KV_CACHE_DTYPES


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the option, the value and what would."""


# ---------------------------------------------------------------- environment (the only reads)
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


def default_max_num_queued_reqs(max_num_seqs: int) -> int:
    return max(MIN_DEFAULT_QUEUED_REQS, DEFAULT_QUEUED_REQS_PER_SEQ * max_num_seqs)


def _split_kv(value: str) -> str:
    from onecard.kernels.paths import SPLIT_KV_POLICIES

    v = value.strip().lower() or SPLIT_KV_POLICIES[0]
    if v not in SPLIT_KV_POLICIES:
        raise ConfigError(f"ONECARD_SPLIT_KV={value} is not a split-KV policy; use one of "
                          f"{', '.join(SPLIT_KV_POLICIES)} or leave it unset (fill).")
    return v


def _emulate_cc(value: str) -> int | None:
    from onecard.kernels.paths import CAPABILITIES

    v = value.strip().lower().replace("sm", "").replace(".", "")
    if not v:
        return None
    if not v.isdigit() or int(v) not in CAPABILITIES:
        raise ConfigError(f"ONECARD_EMULATE_CC={value} is not a capability onecard has branches for; use one of "
                          f"{', '.join(map(str, CAPABILITIES))} (like 70 for a V100) or leave it unset.")
    return int(v)


# ---------------------------------------------------------------- config pieces
def host_tier_blocks(kv_offloading_size_gib: float | None, block_bytes: int) -> int:
    """KV blocks a host tier of ``--kv-offloading-size`` GiB holds (the runner allocates it, the plan reports it)."""
    if not kv_offloading_size_gib or block_bytes <= 0:
        return 0
    return int(kv_offloading_size_gib * 2**30) // block_bytes


@dataclass(slots=True)
class QuantConfig:
    """GPTQ settings read from quantize_config.json or config.json's quantization_config."""

    method: str                    # "gptq"
    bits: int
    group_size: int                # -1 = whole column
    desc_act: bool
    sym: bool
    checkpoint_format: str         # "gptq" (v1, zeros stored minus one) | "gptq_v2"
    lm_head: bool
    dynamic: dict[str, dict[str, Any]] = field(default_factory=dict)  # regex -> overrides; "-:" = skip


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

    # Shapes used by the KV cache and the planner.
    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads", self.hf_config["num_attention_heads"]))

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

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
    max_num_batched_tokens: int = 8192
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
    ``params``. Methods that need a draft model or heads (eagle, mtp, ...) are refused. Not combined with
    ``--async-scheduling`` (refused at start, as vLLM did before it supported the pair): a verify step's
    accepted length must be known before the next step is scheduled."""

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


# ---------------------------------------------------------------- engine args (vLLM names)
@dataclass(slots=True)
class EngineArgs:
    model: str | None = None                   # None = the bundled default model
    revision: str | None = None                # hub branch, tag or commit (also ORG/NAME@REVISION)
    download_dir: str | None = None            # hub cache to look in and download into
    served_model_name: list[str] | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16
    seed: int = 0
    enforce_eager: bool = False
    chat_template: str | None = None
    max_num_queued_reqs: int | None = None
    device: str = "auto"                       # "auto" | "cuda" | "cpu"
    num_gpu_blocks_override: int | None = None  # tests: a tiny KV pool to force preemption
    async_scheduling: bool = False
    engine_threads: int | None = None          # None: ONECARD_ENGINE_THREADS, else default_engine_threads
    kv_offloading_size: float | None = None    # GiB: host-memory tier for prefix blocks the GPU evicts
    kv_offloading_backend: str = "native"      # vLLM's names; onecard has only its own ("native")
    speculative_config: str | dict | None = None   # JSON text or dict (SpeculativeConfig.parse); None = off

    def create_config(self) -> EngineConfig:
        from onecard.models.resolve import DEFAULT_MODEL_NAME, default_model_path, resolve_model

        env = Env.read()
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"--tensor-parallel-size={self.tensor_parallel_size} is not supported: onecard serves one "
                "model on one GPU. Use --tensor-parallel-size=1.")
        if self.pipeline_parallel_size != 1:
            raise ConfigError(
                f"--pipeline-parallel-size={self.pipeline_parallel_size} is not supported: onecard serves one "
                "model on one GPU. Use --pipeline-parallel-size=1.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization={self.gpu_memory_utilization} must be in (0, 1].")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"--block-size={self.block_size} is not supported; use 8, 16, 32, 64 or 128.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype={self.kv_cache_dtype} is unknown; use one of "
                              f"{', '.join(KV_CACHE_DTYPES)}.")

        self._check_offloading()
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and self.async_scheduling:
            raise ConfigError("--speculative-config cannot be combined with --async-scheduling: a verify step's "
                              "accepted length must be known before the next step is scheduled. Drop one of them.")

        if self.model is None:
            path, given = default_model_path(), DEFAULT_MODEL_NAME
            names = self.served_model_name or [DEFAULT_MODEL_NAME]
        else:
            path, given = resolve_model(self.model, env, self.revision, self.download_dir), self.model
            names = self.served_model_name or [self.model.split("@")[0]]

        hf_config = read_json(path / "config.json")
        gen_config = read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
        archs = hf_config.get("architectures") or []
        if not archs:
            raise ConfigError(f"{path / 'config.json'} names no `architectures`; cannot pick a model class.")
        quant = read_quant_config(path, hf_config)
        if self.quantization not in (None, "gptq", "gptq_marlin", "auto"):
            raise ConfigError(f"--quantization={self.quantization} is not supported; onecard runs gptq (4-bit).")
        if self.quantization in ("gptq", "gptq_marlin") and quant is None:
            raise ConfigError(f"--quantization={self.quantization} but {path} has no GPTQ quantization config.")

        device = self.device
        if device == "auto":
            try:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            except ImportError:
                device = "cpu"
        dtype = self._resolve_dtype(hf_config, quant, device)

        max_len_cfg = int(hf_config.get("max_position_embeddings", 4096))
        max_model_len = self.max_model_len or max_len_cfg
        if self.max_model_len and self.max_model_len > max_len_cfg and not hf_config.get("rope_scaling"):
            raise ConfigError(
                f"--max-model-len={self.max_model_len} is larger than the model's max_position_embeddings "
                f"({max_len_cfg}); use --max-model-len<={max_len_cfg}.")
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if not self.enable_chunked_prefill and batched < max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens={batched} is smaller than --max-model-len={max_model_len} with "
                "chunked prefill disabled; raise it or pass --enable-chunked-prefill.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs={self.max_num_seqs} must be at least 1.")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold={self.long_prefill_token_threshold} must be >= 0.")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ConfigError(f"--max-num-queued-reqs={self.max_num_queued_reqs} must be >= 0.")
        queued = self.max_num_queued_reqs
        if queued is None:
            queued = default_max_num_queued_reqs(self.max_num_seqs)
        threads = self.engine_threads or env.engine_threads or default_engine_threads(device, env.cpu_count)
        if threads < 1:
            raise ConfigError(f"--engine-threads={threads} must be at least 1.")

        model = ModelConfig(
            model=given, path=path, hf_config=hf_config, architecture=archs[0], dtype=dtype, quant=quant,
            max_model_len=max_model_len, seed=self.seed, tokenizer=self.tokenizer or str(path),
            chat_template=self.chat_template, served_model_names=list(names), generation_config=gen_config)
        cache = CacheConfig(
            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching, num_gpu_blocks=self.num_gpu_blocks_override,
            kv_offloading_size=self.kv_offloading_size, kv_offloading_backend=self.kv_offloading_backend)
        sched = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill, max_num_queued_reqs=queued,
            async_scheduling=self.async_scheduling)
        return EngineConfig(model=model, cache=cache, scheduler=sched, device=device,
                            enforce_eager=self.enforce_eager, env=env, engine_threads=threads, speculative=spec)

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
        from onecard.hardware import host_memory, host_tier_refusal

        why = host_tier_refusal(int(size * 2**30), host_memory())      # before any weight loads
        if why is not None:
            raise ConfigError(why)

    def _resolve_dtype(self, hf_config: dict, quant: QuantConfig | None, device: str) -> str:
        aliases = {"half": "float16", "fp16": "float16", "float16": "float16", "bf16": "bfloat16",
                   "bfloat16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32"}
        if self.dtype == "auto":
            if quant is not None:
                return "float16" if device == "cuda" else "float32"
            cfg = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
            dtype = aliases.get(cfg, "float32")
            if device != "cuda":
                return "float32"
            if dtype == "bfloat16":
                from onecard.gpu_query import query_gpu  # NVML: no CUDA context in this (the API) process
                from onecard.kernels import paths

                emulated = paths.emulated_capability()          # ONECARD_EMULATE_CC honoured
                if not paths.bf16_allowed(emulated if emulated is not None else paths.as_int(query_gpu().cc)):
                    return "float16"   # as vLLM: bf16 needs sm80+, so "auto" falls back to fp16
            return dtype
        if self.dtype not in aliases:
            raise ConfigError(f"--dtype={self.dtype} is unknown; use auto, float16, bfloat16 or float32.")
        dtype = aliases[self.dtype]
        if quant is not None and dtype == "bfloat16":
            raise ConfigError("--dtype=bfloat16 is not supported with GPTQ (as in vLLM); use --dtype=float16.")
        return dtype


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: not a Hugging Face model directory.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def read_raw_quant_config(path: Path, hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config, else quantize_config.json, unvalidated; None if neither."""
    raw = hf_config.get("quantization_config")
    qfile = path / "quantize_config.json"
    if raw is None and qfile.exists():
        raw = read_json(qfile)
    return raw


def read_quant_config(path: Path, hf_config: dict[str, Any]) -> QuantConfig | None:
    """GPTQ settings from config.json's quantization_config, else quantize_config.json; None if neither."""
    raw = read_raw_quant_config(path, hf_config)
    if raw is None:
        return None
    method = str(raw.get("quant_method", "gptq")).lower()
    if method not in ("gptq",):
        raise ConfigError(f"quantization method {method!r} in {path} is not supported; onecard runs gptq.")
    bits = int(raw.get("bits", 4))
    if bits != 4:
        raise ConfigError(f"GPTQ bits={bits} in {path} is not supported; onecard runs 4-bit GPTQ only.")
    fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"GPTQ checkpoint_format={fmt!r} is not supported; use gptq (v1) or gptq_v2.")
    return QuantConfig(
        method="gptq", bits=bits, group_size=int(raw.get("group_size", 128)),
        desc_act=bool(raw.get("desc_act", False)), sym=bool(raw.get("sym", True)), checkpoint_format=fmt,
        lm_head=bool(raw.get("lm_head", False)), dynamic=dict(raw.get("dynamic") or {}))
