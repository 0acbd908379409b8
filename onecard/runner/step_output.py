"""A step's sampled ids (and logprobs) on their way from the device to the host.

Contract: ``PendingOutput(request_ids, token_ids[S], logprobs, want, async_copy)``. With ``async_copy`` it
starts non-blocking device-to-host copies of the step's sampled ids (and logprobs) into pinned memory and
records an event behind them; ``result()`` then waits for that event alone, not for steps queued on the stream
after it (async scheduling queues the next step before reading this one). Without, it reads them at once (the
synchronous loop's one sync per step, as cheap as it was). ``result()`` returns the step's ``RunnerOutput``;
``PendingOutput.ready(out)`` wraps an output that is already on the host. On the CPU there is no event.
``errors`` (request id -> message: requests that must end, e.g. a grammar dead end) pass through to the output.
"""
from __future__ import annotations

import torch

from onecard.protocol import TokenLogprobs
from onecard.runner.sampler import SamplerResult
from onecard.runner.step_io import RunnerOutput


class PendingOutput:
    __slots__ = ("_errors", "_event", "_ids", "_lp", "_ready", "_tokens", "_want")

    def __init__(self, request_ids: list[str], token_ids: torch.Tensor, logprobs: SamplerResult | None,
                 want: list[int | None], async_copy: bool, errors: dict[str, str] | None = None) -> None:
        cuda = token_ids.is_cuda and async_copy

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            # a non-blocking copy from the GPU lands in pinned memory (PyTorch allocates it so)
            return t.to("cpu", non_blocking=True) if (t is not None and cuda) else t

        self._ids = request_ids
        self._tokens = host(token_ids)                                     # [S] int64
        self._lp = None if logprobs is None else tuple(
            host(t) for t in (logprobs.logprobs, logprobs.ranks, logprobs.top_ids, logprobs.top_logprobs))
        self._want = want
        self._errors = errors
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._ready: RunnerOutput | None = None
        if not async_copy:
            self.result()

    @classmethod
    def ready(cls, output: RunnerOutput) -> PendingOutput:
        p = cls.__new__(cls)
        p._ready = output
        return p

    def result(self) -> RunnerOutput:
        if self._ready is not None:
            return self._ready
        if self._event is not None:
            self._event.synchronize()
        tokens = self._tokens.tolist()
        out = RunnerOutput(sampled_token_ids=dict(zip(self._ids, tokens)))
        if self._errors:
            out.errors = self._errors
        if self._lp is not None:
            chosen_t, ranks_t, top_ids_t, top_lp_t = self._lp
            chosen, ranks = chosen_t.tolist(), ranks_t.tolist()
            top_ids = top_ids_t.tolist() if top_ids_t is not None else None
            top_lp = top_lp_t.tolist() if top_lp_t is not None else None
            for i, rid in enumerate(self._ids):
                n = self._want[i]
                if n is None:
                    continue
                top = dict(zip(top_ids[i][:n], top_lp[i][:n])) if (n and top_ids is not None) else {}
                out.logprobs[rid] = TokenLogprobs(tokens[i], chosen[i], ranks[i], top)
        self._ready = out
        return out
