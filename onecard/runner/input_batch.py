"""Turn a SchedulerOutput into flat device tensors for one forward (numpy on the host, one copy each).

Contract: ``build_inputs(sched, block_size, cached_tables, last_rows) -> ModelInputs``. Rows of the flattened
batch follow ``sched.scheduled`` order. ``cached_tables`` maps request id -> numpy array of its block ids, grown
incrementally so a decode step costs O(new blocks), not O(context), per request. A token past a request's
known ids (async scheduling: sampled by the step still in flight; only ever a 1-token decode) is written as 0
and listed in ``placeholder_rows``, with its row in the previous step's sampled ids (``last_rows[request id]``)
in ``placeholder_src``: the runner copies those ids on the device. A request with drafts (speculative decoding)
computes its last known token then its drafts, and has a logit row at each of those 1 + k positions
(``logits_per_sample``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onecard.runner.step_io import SchedulerOutput


@dataclass(slots=True)
class ModelInputs:
    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    slot_mapping: np.ndarray     # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray         # [B] int32
    block_table: np.ndarray      # [B, max_blocks] int32
    logits_indices: np.ndarray   # [S] int64: last row of each sampling request
    sample_rows: list[int]       # indices into sched.scheduled of the S sampling requests
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int       # leading requests with query length 1
    placeholder_rows: list[int] | None = None   # [P] rows whose id is the previous step's sample (else None)
    placeholder_src: list[int] | None = None    # [P] their rows in the previous step's sampled ids
    # speculative decoding: logit rows per sampling request (1 + its drafts), in logits_indices order; None when
    # no request carries drafts (then one row each)
    logits_per_sample: list[int] | None = None


def block_ids_array(cached: dict[str, np.ndarray], req_id: str, block_ids: list[int]) -> np.ndarray:
    arr = cached.get(req_id)
    n = len(block_ids)
    if arr is None or arr.shape[0] > n:
        arr = np.asarray(block_ids, dtype=np.int32)
    elif arr.shape[0] < n:
        arr = np.concatenate([arr, np.asarray(block_ids[arr.shape[0]:], dtype=np.int32)])
    cached[req_id] = arr
    return arr


def leading_decodes(q_lens) -> int:
    """How many requests at the front have query length 1 (the scheduler puts decodes first)."""
    n = 0
    for q in q_lens:
        if q != 1:
            break
        n += 1
    return n


def build_inputs(sched: SchedulerOutput, block_size: int, cached: dict[str, np.ndarray],
                 last_rows: dict[str, int] | None = None) -> ModelInputs:
    reqs = sched.scheduled
    n = len(reqs)
    if n and all(s.num_new_tokens == 1 for s in reqs):
        return _decode_inputs(sched, block_size, cached, last_rows)
    return _general_inputs(sched, block_size, cached, last_rows)


def _placeholder_src(last_rows: dict[str, int] | None, req_id: str) -> int:
    if last_rows is None or req_id not in last_rows:
        raise RuntimeError(f"request {req_id!r} is scheduled for a token that no step in flight samples")
    return last_rows[req_id]


def _general_inputs(sched: SchedulerOutput, block_size: int, cached: dict[str, np.ndarray],
                    last_rows: dict[str, int] | None = None) -> ModelInputs:
    reqs = sched.scheduled
    n = len(reqs)
    q_lens = np.fromiter((s.num_new_tokens for s in reqs), dtype=np.int64, count=n)
    starts = np.fromiter((s.num_computed_tokens for s in reqs), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])

    ids: list[int] = []
    ph_rows: list[int] = []
    ph_src: list[int] = []
    for s in reqs:
        toks = s.request.all_token_ids
        p = s.num_computed_tokens
        if s.draft_token_ids:                                  # the last known token, then the drafts
            ids.append(toks[p])
            ids.extend(s.draft_token_ids)
        elif p < len(toks):
            ids.extend(toks[p:p + s.num_new_tokens])
        else:                                                  # a placeholder (one token, see the contract)
            ph_rows.append(len(ids))
            ph_src.append(_placeholder_src(last_rows, s.request.request_id))
            ids.append(0)
    input_ids = np.asarray(ids, dtype=np.int64)
    assert input_ids.shape[0] == total, "a chunk reaches past its request's known tokens"

    # position of token t = start of its request + (t - first row of its request)
    req_of_row = np.repeat(np.arange(n), q_lens)                           # [T]
    positions = np.arange(total, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)

    tables = [block_ids_array(cached, s.request.request_id, s.block_ids) for s in reqs]
    max_blocks = max((t.shape[0] for t in tables), default=1) or 1
    block_table = np.zeros((n, max_blocks), dtype=np.int32)
    for i, t in enumerate(tables):
        block_table[i, :t.shape[0]] = t
    slot_mapping = (block_table[req_of_row, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)

    seq_lens = (starts + q_lens).astype(np.int32)
    sample_rows = [i for i, s in enumerate(reqs) if s.samples]
    logits_indices = cu[1:][sample_rows] - 1 if sample_rows else np.zeros(0, dtype=np.int64)
    per_sample = None
    if any(reqs[i].draft_token_ids for i in sample_rows):        # every position of a verified request
        per_sample = [len(reqs[i].draft_token_ids or ()) + 1 for i in sample_rows]
        logits_indices = np.concatenate([np.arange(cu[i + 1] - m, cu[i + 1]) for i, m in zip(sample_rows, per_sample)])
    num_decode = leading_decodes(q_lens)
    return ModelInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        query_start_loc=cu.astype(np.int32), seq_lens=seq_lens, block_table=block_table,
        logits_indices=np.asarray(logits_indices, dtype=np.int64), sample_rows=sample_rows,
        max_query_len=int(q_lens.max()) if n else 0, max_seq_len=int(seq_lens.max()) if n else 0,
        num_decode_tokens=num_decode, placeholder_rows=ph_rows or None, placeholder_src=ph_src or None,
        logits_per_sample=per_sample)


def _decode_inputs(sched: SchedulerOutput, block_size: int, cached: dict[str, np.ndarray],
                   last_rows: dict[str, int] | None = None) -> ModelInputs:
    """The same ModelInputs for a step of decodes only (one new token each), in plain Python per request and
    one array each: the general path's ~20 numpy calls cost ~100 µs per step whatever the batch size, and
    this is on the critical path of every decode step (the GPU waits for it)."""
    reqs = sched.scheduled
    n = len(reqs)
    ids, pos, slots, tables = [], [], [], []
    ph_rows: list[int] = []
    ph_src: list[int] = []
    for i, s in enumerate(reqs):
        p = s.num_computed_tokens
        t = block_ids_array(cached, s.request.request_id, s.block_ids)
        toks = s.request.all_token_ids
        if p < len(toks):
            ids.append(toks[p])
        else:
            ph_rows.append(i)
            ph_src.append(_placeholder_src(last_rows, s.request.request_id))
            ids.append(0)
        pos.append(p)
        slots.append(int(t[p // block_size]) * block_size + p % block_size)
        tables.append(t)
    max_blocks = max(t.shape[0] for t in tables) or 1
    block_table = np.zeros((n, max_blocks), dtype=np.int32)
    for i, t in enumerate(tables):
        block_table[i, :t.shape[0]] = t
    positions = np.array(pos, dtype=np.int64)
    sample_rows = [i for i, s in enumerate(reqs) if s.samples]
    return ModelInputs(
        input_ids=np.array(ids, dtype=np.int64), positions=positions, slot_mapping=np.array(slots, dtype=np.int64),
        query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=(positions + 1).astype(np.int32),
        block_table=block_table, logits_indices=np.array(sample_rows, dtype=np.int64), sample_rows=sample_rows,
        max_query_len=1, max_seq_len=max(pos) + 1, num_decode_tokens=n, placeholder_rows=ph_rows or None,
        placeholder_src=ph_src or None)
