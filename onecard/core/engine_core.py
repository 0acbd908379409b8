"""The engine core loop body (process B): scheduler + runner, one step at a time.

Contract: ``EngineCore(config)`` loads the model (through the runner), sizes the KV cache, builds the
scheduler and fills ``info``. ``add_request`` returns an error ``EngineOutput`` when the request is rejected
(too long, queue full) and None when admitted to the queue; ``abort`` returns the aborted requests' final
outputs; ``step()`` runs schedule → execute → update and returns the outputs of that step. A failure inside
the runner fails only the requests of that step (FinishReason.ERROR, status 500) and frees their blocks.
With ``async_scheduling``, ``step()`` schedules and submits step n+1 first,
then waits for step n's sampled ids and updates with them: the GPU has the next step queued while the host
updates, sends outputs, takes new requests and schedules (the scheduler's placeholders make this exact; a
request that stopped at step n has had one more token computed, which is dropped). ``has_unfinished()`` stays
true while a step is in flight.
With ``config.speculative`` the scheduler drafts through a ``Speculator`` (``drafter``: the config's method
unless one is given, e.g. a test's; on a GPU a ``SpecPolicy`` with the card's cost model picks each step's draft
lengths, on the CPU every proposal is verified) and the runner verifies the drafts. With async scheduling too,
the loop is hybrid: plain steps pipeline as above; before scheduling on top of a step in flight the speculator
says whether drafts would be verified if it were resolved (``Scheduler.drain_pays``: a proposal from the tokens
known now, the policy's side-effect-free peek); if so the step in flight is resolved first and the next step is
scheduled with fresh drafts from fully known tokens; a step with drafts is always resolved before the next is
scheduled (its accepted count decides positions); drafts are never scheduled on top of a step in flight.
The runner is driven through its lifecycle protocol (runner/lifecycle.py: load, precompile, size and allocate
the KV cache, capture graphs, host tier, then submit/execute); this module decides which stages run (device,
options). It imports no torch itself: the runner is created through ``runner_factory``.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

from onecard import kv_dtype
from onecard.config import EngineConfig
from onecard.core.request import Request
from onecard.core.scheduler import Scheduler
from onecard.protocol import EngineInfo, EngineOutput, EngineRequest, EngineStats, FinishReason
from onecard.runner.lifecycle import Runner

logger = logging.getLogger(__name__)


def _default_runner_factory(config: EngineConfig) -> Runner:
    from onecard.runner.model_runner import ModelRunner

    return ModelRunner(config)


class EngineCore:
    def __init__(self, config: EngineConfig, runner_factory: Callable[[EngineConfig], Runner] | None = None,
                 drafter=None):
        t0 = time.perf_counter()
        self.config = config
        self.runner: Runner = (runner_factory or _default_runner_factory)(config)
        if config.device == "cuda":
            self.runner.precompile()     # every Triton kernel variant, compiled in parallel before first use
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        if config.device == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs()
        num_host_blocks = 0
        if config.cache.kv_offloading_size:
            num_host_blocks = self.runner.initialize_host_tier()
        speculator = None
        if config.speculative is not None:
            from onecard.core.spec.speculator import Speculator

            speculator = Speculator(config.speculative, drafter, self._spec_policy(config))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, num_host_blocks=num_host_blocks,
                                   kv_block_bytes=self.runner.block_bytes, speculator=speculator)
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight = None                   # (SchedulerOutput, PendingOutput) submitted, not yet updated
        self.num_steps = 0
        self.last_step_tokens = 0
        bs = config.cache.block_size
        capacity = self.scheduler.kv_cache_manager.num_usable_blocks * bs   # block 0 is the null block
        m = config.model
        kv_format = kv_dtype.resolve(config.cache.kv_cache_dtype, m.dtype)
        self.info = EngineInfo(
            num_gpu_blocks=num_blocks, block_size=bs, kv_capacity_tokens=capacity,
            max_concurrency_at_max_len=capacity / config.scheduler.max_model_len,
            weights_bytes=self.runner.weights_bytes, kv_cache_bytes=self.runner.kv_cache_bytes,
            dtype=config.model.dtype, quantization=config.model.quant.method if config.model.quant else None,
            device=config.device, load_seconds=time.perf_counter() - t0, kv_cache_dtype=kv_format,
            kv_bytes_per_token=kv_dtype.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, kv_format),
            gpu_memory_utilization=config.cache.gpu_memory_utilization,
            enable_prefix_caching=config.cache.enable_prefix_caching, num_host_blocks=num_host_blocks)
        gc.collect()
        gc.freeze()  # start-up objects never die: keep them out of the collector's scans (tail latency)
        logger.info("engine ready: %d KV blocks (%d tokens, %s at %d B/token), %.2f GiB weights, %.1f s",
                    num_blocks, capacity, kv_format, self.info.kv_bytes_per_token, self.info.weights_bytes / 2**30,
                    self.info.load_seconds)
        if num_host_blocks:
            logger.info("host KV tier: %d blocks (%d prefix tokens) in %.2f GiB of host memory", num_host_blocks,
                        num_host_blocks * bs, config.cache.kv_offloading_size)

    def _spec_policy(self, config: EngineConfig):
        """The per-step draft length from the verify step's cost on this GPU (core/spec/policy.py); on the CPU
        every proposal is verified in full (no cost model for it)."""
        if config.device != "cuda" or not self.runner.device_name:
            return None
        card = self.runner.device_name
        from onecard.core.spec.cost import CostModel
        from onecard.core.spec.policy import SpecPolicy

        return SpecPolicy(config.speculative.num_speculative_tokens, CostModel.for_engine(config, card))

    def add_request(self, er: EngineRequest) -> EngineOutput | None:
        sp = er.sampling_params
        req = Request(request_id=er.request_id, prompt_token_ids=list(er.prompt_token_ids),
                      sampling_params=sp, arrival_time=er.arrival_time, eos_token_ids=list(er.eos_token_ids))
        return self.scheduler.add_request(req)

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        s.num_steps, s.last_step_tokens = self.num_steps, self.last_step_tokens
        return s

    def _count_step(self, sched) -> None:
        self.num_steps += 1
        self.last_step_tokens = sched.total_num_scheduled_tokens

    def step(self) -> list[EngineOutput]:
        if self.async_scheduling:
            return self._step_async()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._drop_ended(sched)
            return []
        self._count_step(sched)
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # noqa: BLE001 - fail this step's requests (logged in _fail), keep serving
            return self._fail(sched, e)
        return self.scheduler.update(sched, result)

    def _step_async(self) -> list[EngineOutput]:
        """One step of the async loop: plain steps pipeline (one in flight), verify steps are synchronous.

        With speculation and a step in flight, ``Scheduler.drain_pays`` decides first (its drafter and policy work
        overlaps the GPU's step): yes -> resolve the step in flight, then schedule from fully known tokens with
        fresh drafts; no -> schedule a plain step (no drafts) on top of it. A step that carries drafts is resolved
        before this returns: its accepted counts decide the next step's positions."""
        outs: list[EngineOutput] = []
        if self._in_flight is not None and self.scheduler.drain_pays():
            outs = self._resolve_in_flight()
        sched = self.scheduler.schedule(drafts=self._in_flight is None)
        failed: list[EngineOutput] = []
        pending = None
        if sched.is_empty:
            self._drop_ended(sched)
        else:
            self._count_step(sched)
            try:
                pending = self.runner.submit(sched)
            except Exception as e:  # noqa: BLE001 - as in step()
                failed = self._fail(sched, e)
        if self._in_flight is not None:
            outs += self._resolve_in_flight()
        if pending is not None:
            self._in_flight = (sched, pending)
            if sched.has_drafts:
                outs += self._resolve_in_flight()
        return outs + failed

    def _resolve_in_flight(self) -> list[EngineOutput]:
        """Wait for the step in flight's samples and update the scheduler with them (its outputs)."""
        sched, pending = self._in_flight
        self._in_flight = None
        try:
            result = pending.result()
        except Exception as e:  # noqa: BLE001 - as in step()
            return self._fail(sched, e)
        return self.scheduler.update(sched, result)

    def _drop_ended(self, sched) -> None:
        """An empty step still lets the runner drop the state of requests that ended (aborts between steps)."""
        if sched.finished_request_ids or sched.preempted_request_ids:
            self.runner.execute(sched)

    def _fail(self, sched, error: Exception) -> list[EngineOutput]:
        logger.error("engine step failed; failing %d requests", len(sched.scheduled), exc_info=error)
        aborted = self.scheduler.abort([s.request.request_id for s in sched.scheduled])
        for o in aborted:
            o.finish_reason = FinishReason.ERROR
            o.error = f"internal error in the engine step: {type(error).__name__}"
            o.error_status = 500
        return aborted
