"""CUDA graphs for decode steps: captured once at start-up per batch size, replayed each step.

Contract: ``CUDAGraphRunner(model, kv_caches, batch_sizes, max_blocks_per_seq, max_model_len, device,
steps_in_flight)`` (``steps_in_flight``: a step may be submitted before the last one's output was read);
``capture()`` records one graph per batch size (largest first, one shared memory pool);
``try_run(inputs, fill=None) -> hidden[B, H] | None`` replays the smallest graph >= B when every request in the
step is a decode (query length 1), else returns None (the runner runs eagerly); ``fill(input_ids[B], inputs)``,
when given, writes placeholder ids on the device before the replay. Padded rows write no KV
(slot -1) and attend to one key of block 0; their outputs are ignored. The attention metadata inside the graph
uses ``max_seq_len = max_model_len``: kernels must read the real lengths from ``seq_lens`` on the device and use
the host ints only as upper bounds.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.runner.input_batch import ModelInputs

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, batch_sizes: list[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, steps_in_flight: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        b, mb = self.max_bs, max_blocks_per_seq
        # Graph inputs are views of two device buffers, each filled from a pinned host twin by ONE async copy
        # per step (the block table only where rows changed): the step's host time is on the GPU's critical
        # path, and six pageable copies + a strided device copy cost ~60 µs of it.
        pin = device.type == "cuda"
        w64, self._bt0 = -(-b // 2) * 2, -(-b // 4) * 4                  # every view 16-byte aligned
        self._i64_h = torch.zeros(3, w64, dtype=torch.long, pin_memory=pin)   # ids | positions | slots
        self._i32_h = torch.zeros(self._bt0 + b * mb, dtype=torch.int32, pin_memory=pin)  # seq_lens | table
        self._i64_h[2].fill_(-1)
        self._i32_h[:b].fill_(1)
        self._i64_np, self._i32_np = self._i64_h.numpy(), self._i32_h.numpy()
        self._bt_np = self._i32_np[self._bt0:].reshape(b, mb)
        self._i64_d = self._i64_h.to(device, copy=True)
        self._i32_d = self._i32_h.to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = (self._i64_d[0, :b], self._i64_d[1, :b],
                                                             self._i64_d[2, :b])
        self.seq_lens = self._i32_d[:b]
        self.block_table = self._i32_d[self._bt0:].view(b, mb)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._steps_in_flight = steps_in_flight
        self._copied: torch.cuda.Event | None = None       # behind the last step's copies from the pinned twins
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_table=self.block_table[:bs], max_query_len=1,
            max_seq_len=self.max_model_len, num_decode_tokens=bs)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.batch_sizes):
            md = self._metadata(bs)
            for _ in range(2):  # warm up: Triton JIT / autotune outside the capture
                self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, md)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, md)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.batch_sizes,
                    time.perf_counter() - t0)

    def try_run(self, inputs: ModelInputs, fill=None) -> torch.Tensor | None:
        n = inputs.seq_lens.shape[0]
        if inputs.num_decode_tokens != n or n > self.max_bs or inputs.block_table.shape[1] > self.block_table.shape[1]:
            return None
        bs = next(b for b in self.batch_sizes if b >= n)
        # The pinned buffers may be overwritten once the last step's copies out of them have run. Without a step
        # in flight they have (its sampled ids were read); with async scheduling they ran when the step before
        # it ended, which the host has waited for, so this wait is normally already over.
        if self._copied is not None:
            self._copied.synchronize()
        h64, h32, bt = self._i64_np, self._i32_np, self._bt_np
        h64[0, :n], h64[1, :n], h64[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        h64[2, n:bs] = -1                                                # padded rows write no KV
        h32[:n] = inputs.seq_lens
        h32[n:bs] = 1                                                    # ... and attend to one key
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
            fill(self.input_ids[:n], inputs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
