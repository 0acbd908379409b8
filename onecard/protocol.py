"""The only types that cross the boundary between process A (server/frontend) and B (engine core).

Contract: plain picklable dataclasses, no torch. A sends ``EngineRequest``, ``Abort`` and ``MessageKind.STOP``;
B sends tuples tagged by ``MessageKind`` (the tags' one home, imported by both ends): ``(READY, EngineInfo)`` once
loaded, ``(ERROR, text, is_config_error)`` if it could not start, ``(OUT, [EngineOutput], EngineStats)`` once per
loop turn (one ``EngineOutput`` per request that made progress). Stop *strings* are process A's business: on a
match A sends ``Abort`` and finishes the request itself with ``FinishReason.STOP``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from onecard.sampling_params import SamplingParams


class MessageKind(str, enum.Enum):
    """The tag of a message on the A <-> B channel (a pipe, or a queue in --single-process mode)."""

    READY = "ready"      # B -> A: (READY, EngineInfo), the model is loaded and the KV cache allocated
    ERROR = "error"      # B -> A: (ERROR, text, is_config_error), start-up failed; B's loop has returned
    OUT = "out"          # B -> A: (OUT, [EngineOutput], EngineStats), once per loop turn
    STOP = "stop"        # A -> B: the message itself; B's loop returns


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id, or a stop string (set by A)
    LENGTH = "length"    # max_tokens reached, or max_model_len reached
    ABORT = "abort"      # client went away / aborted
    ERROR = "error"      # rejected by the engine (see EngineOutput.error)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams      # n == 1 here: A fans n out into child requests
    arrival_time: float
    eos_token_ids: list[int] = field(default_factory=list)  # from the model's generation_config
    priority: int = 0


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs for one generated token: the sampled token's, and the top-N alternatives (id → logprob)."""

    token_id: int
    logprob: float
    rank: int                     # 1 = most likely
    top: dict[int, float]


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None          # the stop token id that ended it, if any
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0                    # prompt tokens served from the prefix cache
    error: str | None = None                      # set with FinishReason.ERROR (e.g. prompt too long)
    error_status: int = 400
    scheduled_time: float | None = None           # time.monotonic() of first scheduling; on the first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    """A snapshot B publishes for /metrics (sent with outputs)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0                   # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0                 # tokens looked up (cumulative)
    prefix_cache_hits: int = 0                    # tokens found (cumulative)
    num_preemptions: int = 0                      # cumulative
    num_steps: int = 0                            # engine steps run (cumulative)
    last_step_tokens: int = 0                     # tokens (prompt + generated) computed by the latest step
    external_prefix_cache_queries: int = 0        # host KV tier: tokens looked up (cumulative)
    external_prefix_cache_hits: int = 0           # host KV tier: tokens found there, not recomputed (cumulative)
    kv_bytes_to_host: int = 0                     # host KV tier: bytes copied GPU -> host (cumulative)
    kv_bytes_from_host: int = 0                   # host KV tier: bytes copied host -> GPU (cumulative)
    host_kv_cache_usage: float = 0.0              # host KV tier: fraction of its slots in use, 0..1
    # speculative decoding (cumulative; vLLM's vllm:spec_decode_*): sequences verified with drafts, draft
    # tokens, accepted drafts, and accepted drafts per draft position (None when speculation is off)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] | None = None


@dataclass(slots=True)
class EngineInfo:
    """Sent once by B when the model is loaded and the KV cache allocated (start-up logs, /health)."""

    num_gpu_blocks: int
    block_size: int
    kv_capacity_tokens: int
    max_concurrency_at_max_len: float
    weights_bytes: int
    kv_cache_bytes: int
    dtype: str
    quantization: str | None
    device: str
    load_seconds: float
    kv_cache_dtype: str = "auto"                  # the stored format (kv_dtype.resolve): float16, fp8_e5m2, ...
    kv_bytes_per_token: int = 0                   # kv_dtype.bytes_per_token
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0                      # host KV tier (--kv-offloading-size), 0 = off
