"""The runner's step contract: what the scheduler hands the runner each step, and what the runner hands back.
No torch. It lives with the runner, the lower layer, so the core imports it downward; the runner sees a scheduled
request only as a ``StepRequest`` (what it reads; core.request.Request is one) and never writes one.

Contract: the runner computes ``num_new_tokens`` tokens for each scheduled request, starting at
``num_computed_tokens`` (its token ids are ``request.all_token_ids[start:start + n]``), writing their KV
through ``block_ids``. It samples a next token only for requests where ``samples`` is True (the chunk
reaches the end of the known tokens). A request with ``draft_token_ids`` (speculative decoding) computes its last
token then the drafts, and gets back ``verified_token_ids`` instead of one sampled id. Request objects are shared in-process (B owns both sides).
With a host KV tier the step also carries copies as (gpu block, host slot) pairs: ``kv_to_host`` first, then
``kv_from_host``, all done before attention reads any block of the step; with ``kv_transfer_wait`` they must
also queue behind the step still in flight (one of their GPU blocks was freed since it was scheduled).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from onecard.protocol import TokenLogprobs
from onecard.sampling_params import SamplingParams


class StepRequest(Protocol):
    """The fields of a request the runner reads (core.request.Request has them all; the scheduler owns it)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    all_token_ids: list[int]             # prompt + outputs: the token ids a step computes are a slice of it
    eos_token_ids: list[int]
    sampling_params: SamplingParams
    num_output_placeholders: int         # tokens sampled by steps in flight, not yet in output_token_ids

    @property
    def num_output_tokens(self) -> int: ...


@dataclass(slots=True)
class ScheduledRequest:
    request: StepRequest
    num_computed_tokens: int          # before this step
    num_new_tokens: int
    block_ids: list[int]              # every block of the request, in order (covers start + n tokens)
    samples: bool                     # True when start + n == request.num_tokens (or it carries drafts)
    # Speculative decoding: k draft ids computed after the request's last token (num_new_tokens == 1 + k); the
    # runner verifies them (logits at all 1 + k positions) and returns the accepted ones plus one sampled token.
    draft_token_ids: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]            # decodes first, then prefill chunks (stable order)
    total_num_scheduled_tokens: int
    finished_request_ids: set[str] = field(default_factory=set)   # ended since last step: drop runner state
    preempted_request_ids: set[str] = field(default_factory=set)
    kv_to_host: list[tuple[int, int]] = field(default_factory=list)     # (gpu block, host slot): evicted, saved
    kv_from_host: list[tuple[int, int]] = field(default_factory=list)   # (gpu block, host slot): host hits
    kv_transfer_wait: bool = False
    has_drafts: bool = False          # some request carries drafts: a verify step (resolved before the next schedule)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RunnerOutput:
    sampled_token_ids: dict[str, int]                       # request_id -> token, for requests that sample
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)   # request_id -> why it must end (grammar dead end)
    # Requests verified with drafts: the accepted drafts then one sampled token (1..k+1 ids), and their logprobs.
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
