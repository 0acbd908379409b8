"""The host KV tier's bytes and copies (process B, torch): the runner half of core/host_tier.py.

Contract: ``HostKVPool(kv_caches, num_slots, device)`` allocates ``[2 x layers, num_slots, block bytes]`` of host
memory (pinned on CUDA, so copies are asynchronous DMA), one row per (layer, K or V) laid out like the GPU pool's
blocks, as raw bytes (whatever the KV dtype is, a block is copied bit for bit). Pinned memory comes in chunks of
slots (``pinned_chunks``): PyTorch's pinned allocator rounds every allocation up to a power of two, so one 40 GiB
tensor would pin 64 GiB; chunks just under powers of two waste less than a block each. ``transfer(to_host, from_host, wait)`` performs one step's copies, given as
(gpu block, host slot) pairs: first every save (gather the blocks of each layer on the device, copy each run of
consecutive host slots down in one DMA), then every load (each run of host slots up into a device buffer in one
DMA, then one scatter per layer into the pool). On CUDA the copies run on a side stream, which queues behind the
compute stream only when ``wait`` says a block may still be used by the step in flight (otherwise they overlap
it), and the compute stream waits for the side stream before the step's forward, so attention never reads a
block before its copy lands. The host thread never waits. On the CPU the copies are plain and immediate.
``bytes_per_slot`` is the size of one block (all layers, K and V).
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger(__name__)


def pinned_chunks(num_slots: int, bytes_per_slot: int) -> list[int]:
    """Slots per chunk, each chunk at most (and less than one slot under) a power of two of bytes."""
    chunks: list[int] = []
    left = num_slots
    while left > 0:
        size = left * bytes_per_slot
        if (1 << (size - 1).bit_length()) - size < bytes_per_slot:
            n = left                                     # all of it rounds up by less than a block
        else:
            n = max(1, (1 << (size.bit_length() - 1)) // bytes_per_slot)   # under the largest power of two <= size
        chunks.append(n)
        left -= n
    return chunks


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(offset in ``slots``, first slot, length) of each run of consecutive slot numbers, in order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, slots[start], i - start))
            start = i
    return runs


class HostKVPool:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_slots: int,
                 device: torch.device, chunk_slots: list[int] | None = None) -> None:
        self.device = device
        # every (layer, K|V) cache viewed as bytes [num_blocks, block bytes]: a block is one contiguous row
        self.caches = [c.view(torch.uint8).view(c.shape[0], -1) for pair in kv_caches for c in pair]
        first = self.caches[0]
        self.num_slots = num_slots
        self.block_elems = first.shape[1]                               # bytes of one block of one layer
        self.dtype = first.dtype
        self.bytes_per_slot = len(self.caches) * self.block_elems
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        if chunk_slots is None:
            chunk_slots = pinned_chunks(num_slots, self.bytes_per_slot) if cuda else [num_slots]
        assert sum(chunk_slots) == num_slots
        # chunk c holds slots [chunk_start[c], chunk_start[c] + chunk_slots[c]): [2L, n_c, E] bytes each
        self.chunk_start = [sum(chunk_slots[:c]) for c in range(len(chunk_slots))]
        self.chunks = [torch.empty((len(self.caches), n, self.block_elems), dtype=self.dtype, pin_memory=cuda)
                       for n in chunk_slots]
        self.stream = torch.cuda.Stream(device) if cuda else None
        logger.info("host KV tier: %d blocks, %.2f GiB of %s host memory (%.1f s)", num_slots,
                    num_slots * self.bytes_per_slot / 2**30, "pinned" if cuda else "pageable",
                    time.perf_counter() - t0)

    @torch.inference_mode()
    def transfer(self, to_host: list[tuple[int, int]], from_host: list[tuple[int, int]], wait: bool) -> None:
        if not to_host and not from_host:
            return
        if self.stream is None:
            self._copy(to_host, from_host)
            return
        compute = torch.cuda.current_stream(self.device)
        if wait:
            self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(to_host, from_host)
        compute.wait_stream(self.stream)        # the step's forward (and so attention) after the copies

    def _pieces(self, slots: list[int]) -> list[tuple[int, torch.Tensor, int, int]]:
        """(offset in ``slots``, chunk, first slot in it, length) of each run of consecutive slots within a chunk."""
        out = []
        for off, s0, n in slot_runs(slots):
            while n > 0:
                c = bisect.bisect_right(self.chunk_start, s0) - 1
                local = s0 - self.chunk_start[c]
                k = min(n, self.chunks[c].shape[1] - local)
                out.append((off, self.chunks[c], local, k))
                off, s0, n = off + k, s0 + k, n - k
        return out

    def _copy(self, to_host: list[tuple[int, int]], from_host: list[tuple[int, int]]) -> None:
        dev = self.device
        # Copies of one direction are independent (a slot appears once): in slot order, a prefix stored block
        # after block comes back as one run, one DMA per (layer, K|V), whatever order the blocks were evicted in.
        to_host = sorted(to_host, key=lambda p: p[1])
        from_host = sorted(from_host, key=lambda p: p[1])
        if to_host:
            gpu = torch.tensor([g for g, _ in to_host], dtype=torch.long).to(dev, non_blocking=True)   # [n]
            pieces = self._pieces([s for _, s in to_host])
            for j, cache in enumerate(self.caches):
                staged = cache.index_select(0, gpu)                                  # [n, E] on the device
                for off, chunk, s0, n in pieces:
                    chunk[j, s0:s0 + n].copy_(staged[off:off + n], non_blocking=True)
        if from_host:
            gpu = torch.tensor([g for g, _ in from_host], dtype=torch.long).to(dev, non_blocking=True)  # [n]
            pieces = self._pieces([s for _, s in from_host])
            staged = torch.empty((len(from_host), self.block_elems), dtype=self.dtype, device=dev)   # [n, E]
            for j, cache in enumerate(self.caches):
                for off, chunk, s0, n in pieces:
                    staged[off:off + n].copy_(chunk[j, s0:s0 + n], non_blocking=True)
                cache.index_copy_(0, gpu, staged)
