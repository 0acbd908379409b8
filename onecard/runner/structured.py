"""Grammar-constrained sampling in process B: one xgrammar matcher per constrained request, a token bitmask.

Contract: ``GrammarMasker(tokenizer_path, vocab_size, stop_token_ids, max_rows, device)``;
``masks(reqs, pending_token) -> (bitmask[R, W] int32 on the device, rows[R] int64) | None`` fills the bitmask
(W = ceil(V / 32), bit b of word w allows token 32w + b) of the constrained rows among ``reqs`` (one sampling
row each, in order), or returns None when no row is constrained (unconstrained batches pay one attribute
check per request). Several rows are filled in parallel threads (xgrammar's batch matcher). Before filling, each matcher accepts the request's tokens it has not seen: the known
outputs, then, when a step is still in flight (async scheduling), that step's sample ``pending_token(request
id)`` (a host sync on that step alone; the caller has queued this step's forward first, so the GPU keeps
working). With a thinking model the matcher is idle until ``</think>`` (``CompiledConstraint.in_reasoning``),
and ``<think>`` is also allowed as the first token when the model may open a block itself. A request whose
matcher rejects a token or allows none (a dead end) goes to ``errors`` (request id -> message; the scheduler
finishes it with an error and frees its blocks) and is left unconstrained for the step.
``masks_spec(reqs, drafts)`` fills the rows of a speculative verify step (every draft position; the matcher
advances through the drafts and rolls back, runner/spec_verify.py). ``drop(request_id)`` forgets a finished request. ``apply_token_bitmask(logits, bitmask, rows)`` masks logits
in place with plain torch ops (CPU, sm70, sm90; no kernel to compile).
The xgrammar ``TokenizerInfo`` is built the way process A builds it (``onecard.vocab.tokenizer_info``), in a
background thread started at construction when ``eager``; compiled grammars are deserialized once per key.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

_MAX_GRAMMARS = 256


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """logits[S, V] fp32 (in place): -inf where the bit of a constrained row is 0. bitmask[R, W] int32 (device),
    rows[R] int64 (device; None = every row, R == S)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]   # [R, V]
    if rows is None:
        logits.masked_fill_(allowed == 0, float("-inf"))
        return
    sub = logits.index_select(0, rows)                                                      # [R, V]
    sub.masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, rows, sub)


@dataclass(slots=True)
class _State:
    matcher: object
    accepted: int = 0                  # output tokens seen (fed to the matcher, or skipped as reasoning)
    phase: str = "active"              # "think" (inside reasoning), "maybe_think" (first token), "active"
    failed: bool = False


class GrammarMasker:
    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], max_rows: int,
                 device: torch.device, eager: bool = False):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.device = device
        self.words = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        # two host buffers used in turn: one may still be copying to the device while the next step fills
        self._host = [torch.zeros((max_rows, self.words), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._info = None
        self._info_error: BaseException | None = None
        self._info_ready = threading.Event()
        self._info_thread: threading.Thread | None = None
        self._grammars: OrderedDict[str, object] = OrderedDict()
        self._states: dict[str, _State] = {}
        self._batch = None                 # xgrammar BatchGrammarMatcher (threads), made at the first batch fill
        self.errors: dict[str, str] = {}
        self.fill_seconds = 0.0            # host time in masks() (bench/structured_overhead.py reads these)
        self.rows_masked = 0
        self.steps_masked = 0
        if eager:
            self._start_info()

    # ------------------------------------------------------------------ vocabulary
    def _start_info(self) -> None:
        if self._info_thread is not None:
            return

        def build() -> None:
            try:
                from onecard.vocab import load_tokenizer, tokenizer_info

                self._info = tokenizer_info(load_tokenizer(self.tokenizer_path), self.vocab_size,
                                            self.stop_token_ids)
            except BaseException as e:  # noqa: BLE001 - reported to the constrained requests
                self._info_error = e
            finally:
                self._info_ready.set()

        self._info_thread = threading.Thread(target=build, name="onecard-grammar-vocab", daemon=True)
        self._info_thread.start()

    def _tokenizer_info(self):
        self._start_info()
        self._info_ready.wait()
        if self._info is None:
            raise RuntimeError(f"structured outputs are unavailable: {self._info_error}")
        return self._info

    def _grammar(self, key: str, data: str):
        g = self._grammars.get(key)
        if g is None:
            import xgrammar as xgr

            g = xgr.CompiledGrammar.deserialize_json(data, self._tokenizer_info())
            self._grammars[key] = g
            if len(self._grammars) > _MAX_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return g

    # ------------------------------------------------------------------ per request
    def _state(self, req) -> _State:
        st = self._states.get(req.request_id)
        if st is None:
            import xgrammar as xgr

            cc = req.sampling_params.structured_outputs._compiled
            matcher = xgr.GrammarMatcher(self._grammar(cc.key, cc.grammar_json))
            phase = "think" if cc.in_reasoning else ("maybe_think" if cc.think_start is not None else "active")
            st = self._states[req.request_id] = _State(matcher, phase=phase)
        return st

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _advance(self, st: _State, cc, tokens: list[int]) -> str | None:
        for t in tokens:
            st.accepted += 1
            if st.phase == "think":
                if t == cc.think_end:
                    st.phase = "active"
                continue
            if st.phase == "maybe_think":
                if t == cc.think_start:
                    st.phase = "think"
                    continue
                st.phase = "active"
            if st.matcher.is_terminated():
                continue                      # the token after the end (a stop token, or async's extra one)
            if not st.matcher.accept_token(t):
                return f"the structured-output grammar rejected token {t} (output {st.accepted})"
        return None

    def _start(self, r) -> _State | None:
        """The request's matcher state, or None (its error recorded) when it cannot be constrained: it fails alone."""
        try:
            return self._state(r)
        except Exception as e:  # noqa: BLE001 - any failure to build the matcher is this request's error
            self.errors[r.request_id] = f"structured outputs could not start: {e}"
            return None

    def masks(self, reqs, pending_token: Callable[[str], int | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        t0 = time.perf_counter()
        todo: list[tuple[int, _State, object]] = []          # (row in reqs, state, compiled constraint)
        for i, r in enumerate(reqs):
            so = r.sampling_params.structured_outputs
            if so is None or so._compiled is None:
                continue
            rid = r.request_id
            st = self._start(r)
            if st is None or st.failed:
                continue
            cc = so._compiled
            out = r.output_token_ids
            new = out[st.accepted:] if st.accepted < len(out) else []
            if r.num_output_placeholders > 1 and st.accepted <= len(out):   # a step in flight samples one more
                tok = pending_token(rid)
                new = [*new, tok] if tok is not None else new
            err = self._advance(st, cc, new) if new else None
            if err is not None:
                st.failed = True
                self.errors[rid] = err
            elif st.phase != "think" and not st.matcher.is_terminated():
                todo.append((i, st, cc))
            # (reasoning is not constrained; after its stop token comes only async's dropped extra token)
        if not todo:
            self.fill_seconds += time.perf_counter() - t0
            return None
        turn = self._turn
        ev = self._copied[turn]
        if ev is not None:
            ev.synchronize()                                  # this buffer's previous copy to the device has run
        host = self._host[turn]
        host_np = host.numpy()
        n = len(todo)
        if n == 1:
            todo[0][1].matcher.fill_next_token_bitmask(host, 0)
        else:                                                 # rows in parallel threads (xgrammar, GIL released)
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([st.matcher for _, st, _ in todo], host, list(range(n)))
        rows: list[int] = []
        for k, (i, st, cc) in enumerate(todo):
            if st.phase == "maybe_think":                     # the model may open a reasoning block instead
                w, b = divmod(cc.think_start, 32)
                host_np[k, w] |= np.array(1 << b, dtype=np.uint32).view(np.int32)
            elif not host_np[k].any():
                st.failed = True
                self.errors[reqs[i].request_id] = ("the structured-output grammar reached a dead end (no token "
                                                   "can continue it)")
                host_np[k] = -1                               # its row is dropped by the scheduler: allow all
            rows.append(i)
        if self.device.type == "cuda":
            mask = host[:n].to(self.device, non_blocking=True)
            ev = self._copied[turn] or torch.cuda.Event()
            ev.record()
            self._copied[turn] = ev
            self._turn = 1 - turn
        else:       # a copy of the reused buffer (numpy's: torch's clone of 300 KB takes ms on a busy machine)
            mask = torch.from_numpy(host_np[:n].copy())
        row_t = None if n == len(reqs) else torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        self.fill_seconds += time.perf_counter() - t0
        self.rows_masked += n
        self.steps_masked += 1
        return mask, row_t

    def masks_spec(self, reqs, drafts: list[list[int] | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Speculative decoding (synchronous loop): request i has ``1 + len(drafts[i])`` rows, in order; row j is
        masked as a plain decode step would mask it after the drafts before it. The matcher advances through the
        drafts while filling and is rolled back to the request's known outputs afterwards. Rows after a draft the
        grammar rejects are left unmasked: that draft's own row forbids it, so they are never used."""
        t0 = time.perf_counter()
        host_rows: list[np.ndarray] = []
        rows: list[int] = []
        base = 0
        for r, d in zip(reqs, drafts):
            d = d or []
            so = r.sampling_params.structured_outputs
            if so is None or so._compiled is None:
                base += 1 + len(d)
                continue
            rid = r.request_id
            st = self._start(r)
            if st is None:
                base += 1 + len(d)
                continue
            cc = so._compiled
            out = r.output_token_ids
            err = self._advance(st, cc, out[st.accepted:]) if not st.failed and st.accepted < len(out) else None
            if err is not None:
                st.failed = True
                self.errors[rid] = err
            if st.failed:
                base += 1 + len(d)
                continue
            phase, pushed = st.phase, 0
            m = st.matcher
            for j in range(len(d) + 1):
                if phase != "think" and not m.is_terminated():
                    buf = torch.zeros((1, self.words), dtype=torch.int32)
                    m.fill_next_token_bitmask(buf, 0)
                    row = buf.numpy()[0]
                    if phase == "maybe_think":
                        w, b = divmod(cc.think_start, 32)
                        row[w] |= np.array(1 << b, dtype=np.uint32).view(np.int32)
                    elif not row.any():
                        if j == 0:
                            st.failed = True
                            self.errors[rid] = ("the structured-output grammar reached a dead end (no token can "
                                                "continue it)")
                        break
                    host_rows.append(row)
                    rows.append(base + j)
                if j == len(d):
                    break
                t = d[j]                        # advance as _advance does, remembering what to roll back
                if phase == "think":
                    if t == cc.think_end:
                        phase = "active"
                    continue
                if phase == "maybe_think":
                    if t == cc.think_start:
                        phase = "think"
                        continue
                    phase = "active"
                if m.is_terminated():
                    continue
                if not m.accept_token(t):
                    break
                pushed += 1
            if pushed:
                m.rollback(pushed)
            base += 1 + len(d)
        self.fill_seconds += time.perf_counter() - t0
        if not rows:
            return None
        self.rows_masked += len(rows)
        self.steps_masked += 1
        mask = torch.from_numpy(np.stack(host_rows)).to(self.device)
        return mask, torch.tensor(rows, dtype=torch.int64).to(self.device)

    def take_errors(self) -> dict[str, str]:
        errors, self.errors = self.errors, {}
        return errors
