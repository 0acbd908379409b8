"""The engine core's scheduler (vLLM v1 "one model of work"). Pure Python, no torch.

Contract:
- ``add_request(request)`` validates and queues a request; it returns an ``EngineOutput`` with
  ``FinishReason.ERROR`` (and ``error``/``error_status``) instead when the request cannot run: empty prompt,
  prompt + max_tokens over max_model_len (vLLM's messages), more KV than the whole pool, a full queue (503).
  ``max_tokens=None`` becomes ``max_model_len - len(prompt)`` (on a copy of the sampling params).
- ``schedule()`` hands out a token budget (``max_num_batched_tokens``): running requests first, in arrival
  order (decodes and unfinished prefill chunks), then waiting ones FCFS with a prefix-cache lookup, at most
  ``max_num_seqs`` running. When a running request cannot get blocks, the latest-arrived running request is
  preempted (recompute: blocks freed, ``num_computed_tokens = 0``, front of the waiting queue) until it can;
  no new request is admitted in a step that preempted. The oldest request is never preempted for a newer
  one, so every request finishes. Output: decodes (1 new token) first, then prefill chunks, stable order.
  Scheduling a chunk advances ``num_computed_tokens`` at once, and a chunk that samples adds an output
  placeholder, so ``schedule()`` may run again before the step's ``update()`` (async scheduling: one step in
  flight): a request whose placeholder is pending is scheduled for one token, its placeholder (the runner takes
  that id from the previous step's samples), unless the pending token is already known to be its last
  (max_tokens, max_model_len). A preempted request is re-admitted only once its pending token has arrived.
- ``update(scheduler_output, runner_output)`` resolves placeholders: appends sampled tokens (also of requests
  preempted since that step was scheduled), checks stops (EOS unless ignore_eos, stop_token_ids, min_tokens,
  max_tokens, max_model_len), frees finished requests and returns one ``EngineOutput`` per request that got
  a token or finished. Requests that ended since the step was scheduled are skipped. A request in the runner's
  ``errors`` (its grammar reached a dead end) finishes with ``FinishReason.ERROR`` and that message (400).
- Speculative decoding (a ``Speculator``): a decode step of a running request may carry k drafts
  (``ScheduledRequest.draft_token_ids``, 1 + k tokens against the budget, k bounded so that max_tokens,
  max_model_len and --long-prefill-token-threshold hold; drafts that do not fit the free blocks are dropped,
  never preempting anyone). ``update`` sets ``num_computed_tokens`` to the last token plus the accepted drafts,
  frees the blocks beyond (``KVCacheManager.trim``; the prefix cache only ever registers blocks full of known
  tokens), appends the verified tokens one by one with the same stop checks (tokens after a stop are dropped)
  and counts the metrics. Prefill chunks are passed to the drafter (``observe``); ended requests ``finish``.
  ``schedule(drafts=False)`` schedules no drafts (the async loop, on top of a step in flight); ``drain_pays()``
  asks the speculator whether the next step would verify drafts once the step in flight is resolved (a
  proposal from the tokens known now; no state changes but the drafters' indexes and the policy's per-step
  update when it answers no).
- ``abort(ids)`` ends requests with ``FinishReason.ABORT`` and frees their blocks. Finished and aborted ids
  come in the next ``SchedulerOutput.finished_request_ids``; ``preempted_request_ids`` are this step's
  preemptions (never scheduled in the same step). Both mean: drop the runner's per-request state (a
  preempted request comes back later with entirely new block ids). Block 0 is never handed out.
- Host KV tier (``num_host_blocks > 0``): admission looks a prefix up on the GPU, then in host memory; host hits
  count as computed tokens (they are not recomputed) and each step's output carries the copies the runner makes
  before attention (``SchedulerOutput.kv_to_host`` / ``kv_from_host``, core/kv_cache_manager.py). Blocks come
  back only for requests admitted in that step. ``kv_block_bytes`` turns block counts into /metrics bytes.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.block_hash import update_block_hashes
from onecard.core.kv_cache_manager import KVCacheManager
from onecard.core.request import Request, RequestStatus
from onecard.core.spec.speculator import Speculator
from onecard.protocol import EngineOutput, EngineStats, FinishReason
from onecard.runner.step_io import RunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_FINISHED = RequestStatus.FINISHED


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 num_host_blocks: int = 0, kv_block_bytes: int = 0, speculator: Speculator | None = None) -> None:
        self.config = scheduler_config
        self.speculator = speculator
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.kv_block_bytes = kv_block_bytes
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               num_host_blocks=num_host_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []                 # sorted by arrival (admission sequence)
        self._arrival: dict[str, int] = {}               # request id -> arrival sequence number
        self._next_arrival = 0
        # request id -> (eos ids, stop ids, min_tokens, max_tokens): precomputed for update()'s hot loop
        self._stop_info: dict[str, tuple[frozenset[int], frozenset[int], int, int]] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> EngineOutput | None:
        error = self._validate(request)
        if error is not None:
            msg, status = error
            return EngineOutput(request.request_id, [], FinishReason.ERROR, error=msg, error_status=status,
                                num_prompt_tokens=request.num_prompt_tokens)
        sp = request.sampling_params
        if sp.max_tokens is None:
            # A copy: the same SamplingParams may be shared by requests with other prompt lengths.
            try:
                sp = sp.clone(max_tokens=self.max_model_len - request.num_prompt_tokens)
            except ValueError as e:         # e.g. min_tokens above the room left in the context
                return EngineOutput(request.request_id, [], FinishReason.ERROR, error=str(e), error_status=400,
                                    num_prompt_tokens=request.num_prompt_tokens)
            request.sampling_params = sp
        eos = frozenset() if sp.ignore_eos else frozenset(request.eos_token_ids)
        self._stop_info[request.request_id] = (eos, frozenset(sp.stop_token_ids or ()), sp.min_tokens,
                                               sp.max_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1
        if self.kv_cache_manager.enable_prefix_caching:
            update_block_hashes(request, self.block_size, hash_fn=self.kv_cache_manager.hash_fn)
        self.waiting.append(request)
        return None

    def _validate(self, request: Request) -> tuple[str, int] | None:
        n = request.num_prompt_tokens
        length = self.max_model_len
        cfg = self.config
        if request.request_id in self.requests:
            return f"Request id {request.request_id!r} is already in use.", 400
        if n == 0:
            return "The decoder prompt cannot be empty", 400
        if n >= length:
            return (f"The decoder prompt (length {n}) is longer than the maximum model length of {length}. "
                    "Make sure that `max_model_len` is no smaller than the number of text tokens."), 400
        m = request.sampling_params.max_tokens
        if m is None:
            m = length - n
        if m >= length:
            # vLLM's wording for a max_tokens that no prompt could fit (no negative "maximum input length").
            return (f"'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context "
                    f"length is {length} tokens and your request has {n} input tokens ({m} > {length} - {n})."), 400
        if n + m > length:
            return (f"You passed {n} input tokens and requested {m} output tokens. However, the model's "
                    f"context length is only {length} tokens, resulting in a maximum input length of "
                    f"{length - m} tokens. Please reduce the length of the input prompt."), 400
        capacity = self.kv_cache_manager.num_usable_blocks * self.block_size
        if n + m > capacity:
            # It could never run to completion: it would preempt itself forever.
            return (f"The request needs up to {n + m} tokens of KV cache ({n} input + {m} output tokens), but "
                    f"the KV cache holds only {capacity} tokens. Reduce max_tokens or the prompt, or give the "
                    "KV cache more memory (--gpu-memory-utilization, --num-gpu-blocks-override)."), 400
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            return (f"The prompt has {n} tokens, more than --max-num-batched-tokens="
                    f"{cfg.max_num_batched_tokens} with chunked prefill disabled; raise "
                    "--max-num-batched-tokens or pass --enable-chunked-prefill."), 400
        # Requests that free running slots will take at the next step are not queued: the bound counts the
        # rest (as the API process's in-flight cap, --max-num-seqs + --max-num-queued-reqs, does).
        free_slots = max(0, cfg.max_num_seqs - len(self.running))
        if cfg.max_num_queued_reqs is not None and len(self.waiting) >= cfg.max_num_queued_reqs + free_slots:
            return (f"The server is overloaded: {len(self.waiting)} requests are already waiting "
                    f"(--max-num-queued-reqs={cfg.max_num_queued_reqs}). Try again later."), 503
        return None

    def abort(self, request_ids: list[str] | set[str]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        gone_running: set[str] = set()
        gone_waiting: set[str] = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue                                   # unknown or already finished: nothing to do
            (gone_running if req.status == _RUNNING else gone_waiting).add(rid)
            self._finish(req, FinishReason.ABORT)
            outputs.append(EngineOutput(rid, [], FinishReason.ABORT, num_prompt_tokens=req.num_prompt_tokens,
                                        num_cached_tokens=max(req.num_cached_tokens, 0)))
        if gone_running:
            self.running = [r for r in self.running if r.request_id not in gone_running]
        if gone_waiting:
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone_waiting)
        return outputs

    def _finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        rid = req.request_id
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv_cache_manager.free(req)
        if self.speculator is not None:
            self.speculator.finish(req, reason in (FinishReason.ABORT, FinishReason.ERROR))
        del self.requests[rid]
        del self._stop_info[rid]
        del self._arrival[rid]
        self._finished_ids.add(rid)

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        if self.speculator is not None:
            self.speculator.preempted(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)        # before newer waiting requests: it is older than all of them
        logger.debug("preempted %s (%d tokens)", req.request_id, req.num_tokens)

    # ------------------------------------------------------------------ one step
    def schedule(self, drafts: bool = True) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        decodes: list[ScheduledRequest] = []
        verifies: list[ScheduledRequest] = []      # decodes with drafts (speculative decoding): 1 + k tokens
        prefills: list[ScheduledRequest] = []
        preempted: set[str] = set()
        spec = self.speculator
        step_drafts = self._propose_all() if spec is not None and drafts else None

        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            pending = req.num_output_placeholders
            known = len(req.all_token_ids) + pending
            if pending and (len(req.output_token_ids) + pending >= self._stop_info[req.request_id][3]
                            or known >= self.max_model_len):
                i += 1                      # the token in flight is its last: nothing more to compute
                continue
            n = known - start
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            if n <= 0:                      # the runner did not sample it last step: nothing to compute
                i += 1
                continue
            drafts = step_drafts.get(req.request_id) if step_drafts else None
            if drafts and n == 1:
                if len(drafts) >= budget:
                    drafts = drafts[:budget - 1] or None
                if drafts:
                    n += len(drafts)
            else:
                drafts = None
            while True:
                ids = kv.allocate_slots(req, n)
                if ids is not None:
                    break
                if drafts:                  # drafts never preempt anyone: fall back to a plain decode
                    drafts, n = None, 1
                    continue
                victim = running.pop()      # the latest arrival; never one already scheduled this step
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if ids is None:
                break
            samples = start + n == known or drafts is not None
            req.num_computed_tokens = start + n       # drafts included; update() keeps the accepted ones
            if samples:
                req.num_output_placeholders = pending + 1
            if drafts is not None:
                verifies.append(ScheduledRequest(req, start, n, ids, True, drafts))
            elif n == 1:
                decodes.append(ScheduledRequest(req, start, n, ids, samples))
            else:
                prefills.append(ScheduledRequest(req, start, n, ids, samples))
                if spec is not None:
                    spec.observe(req, start + n)
            budget -= n
            i += 1

        if not preempted:
            self._admit_waiting(budget, decodes, prefills)

        finished, self._finished_ids = self._finished_ids, set()
        decodes.extend(verifies)
        decodes.extend(prefills)
        total = sum(sr.num_new_tokens for sr in decodes)
        out = SchedulerOutput(decodes, total, finished, preempted, has_drafts=bool(verifies))
        if kv.host is not None:
            t = kv.take_transfers()
            out.kv_to_host, out.kv_from_host, out.kv_transfer_wait = t.to_host, t.from_host, t.wait
        return out

    def _admit_waiting(self, budget: int, decodes: list[ScheduledRequest],
                       prefills: list[ScheduledRequest]) -> None:
        cfg = self.config
        kv = self.kv_cache_manager
        threshold = cfg.long_prefill_token_threshold
        waiting, running, arrival = self.waiting, self.running, self._arrival
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            if kv.num_free_blocks == 0:
                break                       # its last token always needs a fresh block: skip the lookup
            req = waiting[0]
            if req.num_output_placeholders:
                break                       # preempted with a token in flight: re-admit once it has arrived
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break                   # FCFS: it waits for a step with room, and so do later ones
                n = budget
            ids = kv.allocate_slots(req, n, hit_blocks)
            if ids is None:
                break
            waiting.popleft()
            samples = num_hit + n == req.num_tokens
            req.num_computed_tokens = num_hit + n
            if samples:
                req.num_output_placeholders = 1
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.scheduled_time = time.monotonic()
            req.status = _RUNNING
            key = arrival[req.request_id]
            if not running or arrival[running[-1].request_id] < key:
                running.append(req)
            else:                           # a re-admitted preempted request goes back to its place
                bisect.insort(running, req, key=lambda r: arrival[r.request_id])
            sr = ScheduledRequest(req, num_hit, n, ids, samples)
            (decodes if n == 1 else prefills).append(sr)
            if self.speculator is not None:
                self.speculator.observe(req, num_hit + n)
            budget -= n

    def _propose_all(self) -> dict[str, list[int]]:
        """Drafts for this step's decodes (requests whose next token is their only one to compute), each at most
        what max_tokens, max_model_len and --long-prefill-token-threshold leave room for (a step emits the
        accepted drafts plus one token); the step's budget trims them in ``schedule``."""
        cands, prefill = self._decode_candidates(stale=False)
        return self.speculator.propose_step([(req, k) for req, k, _ in cands], prefill) if cands else {}

    def drain_pays(self) -> bool:
        """With a step in flight (async scheduling): would the next step verify drafts if the step in flight were
        resolved first? (``Speculator.drain_pays``: proposals from the tokens known now, the policy's peek.)"""
        if self.speculator is None:
            return False
        cands, prefill = self._decode_candidates(stale=True)
        return self.speculator.drain_pays(cands, prefill) if cands else False

    def _decode_candidates(self, stale: bool) -> tuple[list[tuple[Request, int, int]], int]:
        """(request, the most drafts it may take, tokens still in flight) for each running request whose next
        step computes one token, and the prefill tokens of the others. ``stale``: as the requests will be once
        the step in flight is resolved (its placeholders known); otherwise a request with a placeholder pending
        gets no drafts (its last token is not known yet)."""
        threshold = self.config.long_prefill_token_threshold
        stop_info, max_len = self._stop_info, self.max_model_len
        cands: list[tuple[Request, int, int]] = []
        prefill = 0
        for req in self.running:
            pending = req.num_output_placeholders
            if pending and not stale:
                continue                    # scheduled for its placeholder only (nothing of it is prefill)
            known = len(req.all_token_ids) + pending
            todo = known - req.num_computed_tokens
            if todo != 1:
                prefill += min(todo, threshold) if threshold > 0 else max(todo, 0)
                continue
            max_k = min(stop_info[req.request_id][3] - len(req.output_token_ids) - pending, max_len - known) - 1
            if threshold > 0:
                max_k = min(max_k, threshold - 1)
            cands.append((req, max(max_k, 0), pending))
        return cands, prefill

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[EngineOutput]:
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        errors = runner_output.errors
        max_model_len = self.max_model_len
        stop_info = self._stop_info
        outputs: list[EngineOutput] = []
        any_finished = False
        preempted_finished = False
        for sr in scheduler_output.scheduled:
            if not sr.samples:
                continue
            req = sr.request
            status = req.status
            if status is _FINISHED:             # ended (aborted, stopped) since this step was scheduled
                continue
            req.num_output_placeholders -= 1
            rid = req.request_id
            if sr.draft_token_ids is not None:
                token = None
                verified = runner_output.verified_token_ids.get(rid)
                if verified is None:
                    continue
                self._accept_drafts(sr, verified)
            else:
                token = sampled.get(rid)
                if token is None:
                    continue
            if errors and rid in errors:
                outputs.append(EngineOutput(rid, [], FinishReason.ERROR, error=errors[rid], error_status=400,
                                            num_prompt_tokens=len(req.prompt_token_ids)))
                self._finish(req, FinishReason.ERROR)
                if status is _PREEMPTED:
                    preempted_finished = True
                else:
                    any_finished = True
                continue
            if token is None:                   # a verify step: several tokens
                out = self._append_verified(req, verified, runner_output.verified_logprobs.get(rid))
                outputs.append(out)
                if out.finish_reason is not None:
                    self._finish(req, out.finish_reason, out.stop_reason)
                    if status is _PREEMPTED:
                        preempted_finished = True
                    else:
                        any_finished = True
                continue
            out_ids = req.output_token_ids
            out_ids.append(token)               # Request.append_output_token, inlined (hot loop)
            req.all_token_ids.append(token)
            eos, stop_ids, min_tokens, max_tokens = stop_info[rid]
            num_out = len(out_ids)
            reason = None
            stop_reason = None
            if num_out >= min_tokens:
                if token in eos:
                    reason = FinishReason.STOP
                elif token in stop_ids:
                    reason = FinishReason.STOP
                    stop_reason = token
            if reason is None and (num_out >= max_tokens or len(req.all_token_ids) >= max_model_len):
                reason = FinishReason.LENGTH
            lp = logprobs.get(rid) if logprobs else None
            cached = req.num_cached_tokens
            out = EngineOutput(rid, [token], reason, stop_reason, None if lp is None else [lp],
                               len(req.prompt_token_ids), max(0, cached))
            if num_out == 1:
                out.scheduled_time = req.scheduled_time
            outputs.append(out)
            if reason is not None:
                self._finish(req, reason, stop_reason)
                if status is _PREEMPTED:
                    preempted_finished = True
                else:
                    any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if preempted_finished:              # preempted while its last token was in flight
            self.waiting = deque(r for r in self.waiting if r.status is not _FINISHED)
        return outputs

    def _accept_drafts(self, sr: ScheduledRequest, verified: list[int]) -> None:
        """KV stays valid for the last token and the accepted drafts: roll the rest back (slots, blocks)."""
        req = sr.request
        num_accepted = len(verified) - 1
        self.speculator.record(req, len(sr.draft_token_ids), num_accepted)
        if req.status is _RUNNING:          # (a preempted request has no blocks and restarts from 0)
            req.num_computed_tokens = sr.num_computed_tokens + 1 + num_accepted
            self.kv_cache_manager.trim(req, req.num_computed_tokens)

    def _append_verified(self, req: Request, tokens: list[int], lps: list | None) -> EngineOutput:
        """Append a verify step's tokens one by one, each checked for a stop as a single decode's would be; the
        tokens after a stop are dropped."""
        eos, stop_ids, min_tokens, max_tokens = self._stop_info[req.request_id]
        out_ids, all_ids = req.output_token_ids, req.all_token_ids
        reason = stop_reason = None
        n = 0
        for token in tokens:
            out_ids.append(token)
            all_ids.append(token)
            n += 1
            num_out = len(out_ids)
            if num_out >= min_tokens:
                if token in eos:
                    reason = FinishReason.STOP
                elif token in stop_ids:
                    reason, stop_reason = FinishReason.STOP, token
            if reason is None and (num_out >= max_tokens or len(all_ids) >= self.max_model_len):
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        cached = req.num_cached_tokens
        out = EngineOutput(req.request_id, tokens[:n], reason, stop_reason, None if lps is None else lps[:n],
                           len(req.prompt_token_ids), max(0, cached))
        if len(out_ids) == n:
            out.scheduled_time = req.scheduled_time
        return out

    # ------------------------------------------------------------------ state
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        host = kv.host
        s = EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
                           prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=self.num_preemptions,
                           external_prefix_cache_queries=kv.host_queries,
                           external_prefix_cache_hits=kv.host_hits,
                           kv_bytes_to_host=kv.blocks_to_host * self.kv_block_bytes,
                           kv_bytes_from_host=kv.blocks_from_host * self.kv_block_bytes,
                           host_kv_cache_usage=host.usage if host is not None else 0.0)
        if self.speculator is not None:
            c = self.speculator.counts
            s.spec_num_drafts, s.spec_num_draft_tokens = c.num_drafts, c.num_draft_tokens
            s.spec_num_accepted_tokens, s.spec_accepted_per_pos = c.num_accepted_tokens, list(c.accepted_per_pos)
        return s
