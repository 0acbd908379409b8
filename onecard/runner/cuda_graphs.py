"""CUDA graphs for decode steps: captured once at start-up per batch size, replayed each step.

Contract: ``CUDAGraphRunner(model, kv_caches, batch_sizes, max_blocks_per_seq, max_model_len)``;
``capture()`` records one graph per batch size (largest first, one shared memory pool);
``try_run(inputs) -> hidden[B, H] | None`` replays the smallest graph >= B when every request in the step is
a decode (query length 1), else returns None (the runner runs eagerly). Padded rows write no KV
(slot -1) and attend to one key of block 0; their outputs are ignored. The attention metadata inside the graph
uses ``max_seq_len = max_model_len``: kernels must read the real lengths from ``seq_lens`` on the device and use
the host ints only as upper bounds.
"""
from __future__ import annotations

import logging
import time

import torch

from onecard.runner.attn_metadata import AttentionMetadata
from onecard.runner.input_batch import ModelInputs

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, batch_sizes: list[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        b, mb = self.max_bs, max_blocks_per_seq
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(b, mb, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
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

    def try_run(self, inputs: ModelInputs) -> torch.Tensor | None:
        n = inputs.seq_lens.shape[0]
        if inputs.num_decode_tokens != n or n > self.max_bs or inputs.block_table.shape[1] > self.block_table.shape[1]:
            return None
        bs = next(b for b in self.batch_sizes if b >= n)
        dev = self.device
        self.input_ids[:n].copy_(torch.from_numpy(inputs.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(inputs.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(inputs.slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(inputs.seq_lens), non_blocking=True)
        w = inputs.block_table.shape[1]
        self.block_table[:n, :w].copy_(torch.from_numpy(inputs.block_table).to(dev, non_blocking=True))
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
