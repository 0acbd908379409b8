"""CUDA graphs for decode and speculative verify steps: captured once at start-up, replayed each step.

Contract: ``CUDAGraphRunner(model, kv_caches, batch_sizes, max_blocks_per_seq, max_model_len, device,
steps_in_flight, verify_shapes=())`` (``steps_in_flight``: a step may be submitted before the last one's output
was read; ``verify_shapes``: (b, q) pairs from runner/graph_shapes.verify_graph_shapes, empty without
--speculative-config); ``capture()`` records one graph per decode batch size, then one per verify shape (most rows
first), all in one shared memory pool, and keeps ``capture_stats`` (seconds and device bytes of each kind);
``replays`` counts the steps served per (b, q).
``try_run(inputs, fill=None) -> hidden[T, H] | None``, T = the step's rows in input order:
  * a decode step (every request query length 1) replays the smallest decode graph >= B;
  * a verify step (every request samples at each of its 1 + k_i rows: decodes with or without drafts, no
    prefill chunk) replays the verify graph (smallest b >= B, q = 1 + max k_i) in the layout ``pad_verify``
    builds: sequence i owns rows i*q .. i*q+q-1, its real rows first, then pad rows;
  * anything else returns None (the runner runs it eagerly), also a verify shape with no graph.
``fill(input_ids, inputs)``, when given, writes placeholder ids on the device before the replay (into the
padded layout's rows for a verify step). Pad rows write no KV (slot -1); a padded sequence's seq_len counts its
pad rows, so the kernels' rule "query row j sits at position seq_len - query_len + j" keeps every real row at
its true position and the causal mask keeps the pad rows (which come after) out of every real row's attention;
sequences past B attend to their own q keys of whatever blocks their stale table row names. Outputs of pad rows
are dropped. Inside a graph nothing syncs with the host: the attention metadata uses ``max_seq_len`` =
max_model_len (decode) or max_model_len + q - 1 (verify), which sets the split only; kernels read the real
lengths from ``seq_lens`` on the device, and the block table is wide enough for a padded sequence's last key.
(Decode graphs per context class, a smaller bound's split for short contexts, were measured and removed: the
unsplit class ran batch 1's attention block at 41.8 µs against 26.8 at the 65,536 bound; BENCHMARKS.md,
2026-12-07.)
Off CUDA (tests) nothing is captured: each "replay" runs the model eagerly on the same static buffers and
metadata, so the padded layout is exercised exactly as a graph would see it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.runner.input_batch import ModelInputs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PaddedVerify:
    """A verify step laid out for the (b, q) graph: b sequences of q rows each."""
    input_ids: np.ndarray     # [b*q] int64 (pad rows: 0)
    positions: np.ndarray     # [b*q] int64 (pad rows: the next positions, clamped to max_position)
    slot_mapping: np.ndarray  # [b*q] int64 (pad rows: -1, no KV write)
    seq_lens: np.ndarray      # [b] int32 (real length + this sequence's pad rows; q for padded sequences)
    rows: np.ndarray          # [T] int64: the padded row of each input row


def pad_verify(query_start_loc: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
               slot_mapping: np.ndarray, seq_lens: np.ndarray, b: int, q: int, max_position: int) -> PaddedVerify:
    """The (b, q) layout of a step of n <= b sequences with 1 <= query_len_i <= q rows each (pure numpy)."""
    n = seq_lens.shape[0]
    qsl = query_start_loc.astype(np.int64)
    q_lens = np.diff(qsl)                                                       # [n]
    if n > b or n == 0 or q_lens.min() < 1 or q_lens.max() > q:
        raise ValueError(f"a step of {n} sequences with query lengths {q_lens.tolist()} does not fit ({b}, {q})")
    t = int(qsl[-1])
    seq_of = np.repeat(np.arange(n), q_lens)                                    # [T]
    rows = seq_of * q + (np.arange(t) - qsl[:-1][seq_of])                       # [T]
    first = np.zeros(b, dtype=np.int64)                                         # position of each first row
    first[:n] = positions[qsl[:-1]]
    pos = np.minimum(first[:, None] + np.arange(q)[None, :], max_position).reshape(-1)   # [b*q]
    pos[rows] = positions                                                       # real rows: exact
    ids = np.zeros(b * q, dtype=np.int64)
    ids[rows] = input_ids
    slots = np.full(b * q, -1, dtype=np.int64)
    slots[rows] = slot_mapping
    lens = np.full(b, q, dtype=np.int32)
    lens[:n] = seq_lens + (q - q_lens)
    return PaddedVerify(ids, pos, slots, lens, rows)


def verify_query_len(inputs: ModelInputs) -> int | None:
    """q = 1 + max k_i when ``inputs`` is a verify step (every request samples at each of its rows), else None."""
    per = inputs.logits_per_sample
    n = inputs.seq_lens.shape[0]
    if per is None or len(inputs.sample_rows) != n:
        return None
    q_lens = np.diff(inputs.query_start_loc)
    if not np.array_equal(q_lens, per):
        return None                                                  # a prefill chunk is in the step
    return int(q_lens.max())


def graph_bound(max_model_len: int, q: int) -> int:
    """The metadata bound (max_seq_len) of a graph of ``q`` query rows a sequence: max_model_len for a decode graph,
    max_model_len + q - 1 (a padded sequence's last key) for a verify graph. It sets the attention's split only
    (runner/precompile.py's dry run records the same launches with it)."""
    return max_model_len + q - 1


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, batch_sizes: list[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, steps_in_flight: bool = False,
                 verify_shapes: list[tuple[int, int]] | tuple = ()):
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        self.use_graphs = device.type == "cuda"
        self.verify_shapes = sorted(set(verify_shapes))
        max_q = max((q for _, q in self.verify_shapes), default=1)
        rows = max([self.max_bs] + [b * q for b, q in self.verify_shapes])
        block_size = kv_caches[0][0].shape[1] if kv_caches else 1
        b, mb = self.max_bs, max_blocks_per_seq + -(-(max_q - 1) // block_size)   # padded keys' blocks too
        # Graph inputs are views of two device buffers, each filled from a pinned host twin by ONE async copy
        # per step (the block table only where rows changed): the step's host time is on the GPU's critical
        # path, and six pageable copies + a strided device copy cost ~60 µs of it.
        pin = self.use_graphs
        w64, self._bt0 = -(-rows // 2) * 2, -(-b // 4) * 4                # every view 16-byte aligned
        # ids | positions | slots | (verify) the padded row of each real row
        self._i64_h = torch.zeros(4, w64, dtype=torch.long, pin_memory=pin)
        self._i32_h = torch.zeros(self._bt0 + b * mb, dtype=torch.int32, pin_memory=pin)  # seq_lens | table
        self._i64_h[2].fill_(-1)
        self._i32_h[:b].fill_(1)
        self._i64_np, self._i32_np = self._i64_h.numpy(), self._i32_h.numpy()
        self._bt_np = self._i32_np[self._bt0:].reshape(b, mb)
        self._i64_d = self._i64_h.to(device, copy=True)
        self._i32_d = self._i32_h.to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = self._i64_d[0], self._i64_d[1], self._i64_d[2]
        self.real_rows = self._i64_d[3]
        self.seq_lens = self._i32_d[:b]
        self.block_table = self._i32_d[self._bt0:].view(b, mb)
        self._qsl = {q: torch.arange(b + 1, dtype=torch.int32, device=device) * q
                     for q in {1} | {q for _, q in self.verify_shapes}}
        self._steps_in_flight = steps_in_flight and self.use_graphs
        self._copied: torch.cuda.Event | None = None       # behind the last step's copies from the pinned twins
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}   # (b, q) -> graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.shapes: set[tuple[int, int]] = set()          # (b, q) shapes try_run serves
        self.pool = None
        self.capture_stats: dict[str, float] = {}
        self.replays: Counter[tuple[int, int]] = Counter()   # steps served per (b, q) shape

    def bound(self, q: int) -> int:
        """graph_bound of this runner's graphs of ``q`` query rows a sequence."""
        return graph_bound(self.max_model_len, q)

    def _metadata(self, bs: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs * q], query_start_loc=self._qsl[q][:bs + 1],
            seq_lens=self.seq_lens[:bs], block_table=self.block_table[:bs], max_query_len=q,
            max_seq_len=self.bound(q), num_decode_tokens=bs if q == 1 else 0)

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        bs, q = key
        t = bs * q
        return self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._metadata(bs, q))

    def _capture_one(self, key: tuple[int, int]) -> None:
        bs, q = key
        self.seq_lens[:bs].fill_(q)                     # a sane warm-up: every row sees its own keys
        for _ in range(2):  # warm up: Triton JIT / autotune outside the capture
            self._forward(key)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._forward(key)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[key] = g
        self.outputs[key] = out

    @torch.inference_mode()
    def capture(self) -> None:
        decode = [(bs, 1) for bs in reversed(self.batch_sizes)]
        verify = sorted(self.verify_shapes, key=lambda s: (-s[0] * s[1], -s[1]))
        if not self.use_graphs:                         # off CUDA: the same layouts, run eagerly
            self.shapes = set(decode + verify)
            return
        for kind, keys in (("decode", decode), ("verify", verify)):
            if not keys:
                continue
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            for key in keys:
                self._capture_one(key)
            torch.cuda.synchronize()
            self.capture_stats[f"{kind}_s"] = time.perf_counter() - t0
            self.capture_stats[f"{kind}_bytes"] = float(free0 - torch.cuda.mem_get_info()[0])
            self.capture_stats[f"{kind}_graphs"] = float(len(keys))
        self.seq_lens.fill_(1)
        self.shapes = set(decode + verify)
        logger.info("captured CUDA graphs for decode batch sizes %s (%d graphs, %.1f s) and %d verify shapes (%.1f s, "
                    "%.0f MiB)", self.batch_sizes, len(decode), self.capture_stats.get("decode_s", 0.0), len(verify),
                    self.capture_stats.get("verify_s", 0.0), self.capture_stats.get("verify_bytes", 0.0) / 2**20)

    def try_run(self, inputs: ModelInputs, fill=None) -> torch.Tensor | None:
        n = inputs.seq_lens.shape[0]
        if n == 0 or n > self.max_bs or inputs.block_table.shape[1] > self.block_table.shape[1]:
            return None
        if inputs.num_decode_tokens == n:
            q = 1
        else:
            q = verify_query_len(inputs)
            if q is None:
                return None
        bs = next(b for b in self.batch_sizes if b >= n)
        if (bs, q) not in self.shapes:
            return None
        # The pinned buffers may be overwritten once the last step's copies out of them have run. Without a step
        # in flight they have (its sampled ids were read); with async scheduling they ran when the step before
        # it ended, which the host has waited for, so this wait is normally already over.
        if self._copied is not None:
            self._copied.synchronize()
        h64, h32, bt = self._i64_np, self._i32_np, self._bt_np
        if q == 1:
            h64[0, :n], h64[1, :n], h64[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
            h64[2, n:bs] = -1                                            # padded rows write no KV
            h32[:n] = inputs.seq_lens
            h32[n:bs] = 1                                                # ... and attend to one key
        else:
            p = pad_verify(inputs.query_start_loc, inputs.input_ids, inputs.positions, inputs.slot_mapping,
                           inputs.seq_lens, bs, q, self.max_model_len - 1)
            t = bs * q
            h64[0, :t], h64[1, :t], h64[2, :t] = p.input_ids, p.positions, p.slot_mapping
            h64[3, :p.rows.shape[0]] = p.rows
            h32[:bs] = p.seq_lens
            if inputs.placeholder_rows:                                  # their rows in the padded layout
                inputs = dataclasses.replace(inputs, placeholder_rows=p.rows[inputs.placeholder_rows].tolist())
        self._i64_d.copy_(self._i64_h, non_blocking=True)
        w = inputs.block_table.shape[1]
        changed = np.flatnonzero((bt[:n, :w] != inputs.block_table).any(axis=1))
        if changed.size:                                                 # entries past a row's blocks are
            r0, r1 = int(changed[0]), int(changed[-1]) + 1               # never read (stale is fine)
            bt[r0:r1, :w] = inputs.block_table[r0:r1]
            a, z = self._bt0 + r0 * bt.shape[1], self._bt0 + r1 * bt.shape[1]
            self._i32_d[a:z].copy_(self._i32_h[a:z], non_blocking=True)
        self._i32_d[:bs].copy_(self._i32_h[:bs], non_blocking=True)
        if self._steps_in_flight:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        if fill is not None:
            fill(self.input_ids[:bs * q], inputs)
        self.replays[(bs, q)] += 1
        if self.use_graphs:
            self.graphs[(bs, q)].replay()
            out = self.outputs[(bs, q)]
        else:
            out = self._forward((bs, q))
        if q == 1:
            return out[:n]
        return out.index_select(0, self.real_rows[:inputs.input_ids.shape[0]])      # [T, H], input order
