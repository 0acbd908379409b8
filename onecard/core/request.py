"""A request inside the engine core (process B): token bookkeeping only, no torch.

Contract: ``all_token_ids = prompt_token_ids + output_token_ids``; ``num_computed_tokens`` counts tokens
whose KV is in the cache (including prefix-cache hits). Each step the scheduler gives a request
``num_tokens - num_computed_tokens`` (or a chunk of it) new tokens to compute. On preemption
(recompute) the request keeps its outputs, drops its blocks and ``num_computed_tokens`` goes back to 0.
``num_computed_tokens`` advances when a step is scheduled, not when it returns; a step that samples adds a
placeholder (``num_output_placeholders``) for the token it will produce, resolved when its output arrives. With
async scheduling the next step is scheduled while one is in flight, so a request can be scheduled to compute its
placeholder token: the runner reads that token id from the previous step's samples on the device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from onecard.protocol import FinishReason
from onecard.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0     # tokens sampled by scheduled steps, not yet appended
    num_cached_tokens: int = -1          # prompt tokens hit in the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of full blocks (prefix cache)
    scheduled_time: float = 0.0          # time.monotonic() when first scheduled (queue-time metric)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 30

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
