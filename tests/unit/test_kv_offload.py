"""The host tier's copies (runner/kv_offload.py) on the CPU: blocks go down and come back bit for bit.

The reference is plain indexing of the per-layer caches: after saving blocks to host slots, clobbering the GPU pool
and loading the slots into other blocks, every (layer, K/V) block must equal what was saved, and blocks not named
in a copy must be untouched.
"""
from __future__ import annotations

import random

import pytest
import torch

from onecard.runner.kv_offload import HostKVPool, pinned_chunks, slot_runs


def test_slot_runs() -> None:
    assert slot_runs([]) == []
    assert slot_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


@pytest.mark.parametrize("num_slots,bps", [(43690, 3 << 19), (27306, 3 << 19), (1, 3 << 19), (1000, 4096),
                                           (7, 100)])
def test_pinned_chunks_waste_less_than_a_block_each(num_slots: int, bps: int) -> None:
    """Each chunk, rounded up to a power of two of bytes as PyTorch's pinned allocator does, wastes < one block."""
    chunks = pinned_chunks(num_slots, bps)
    assert sum(chunks) == num_slots and all(n >= 1 for n in chunks)
    for n in chunks:
        size = n * bps
        pinned = 1 << (size - 1).bit_length()
        assert pinned - size < bps or n == 1
    total = sum(1 << (n * bps - 1).bit_length() for n in chunks)
    assert total - num_slots * bps < len(chunks) * bps
    assert pinned_chunks(16 * 2**30 // (3 << 19), 3 << 19) == [16 * 2**30 // (3 << 19)]   # 16 GiB: one chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_save_then_load_round_trip(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    layers, nb, bs, heads, hd = 3, 12, 4, 2, 8
    caches = [(torch.randn(nb, bs, heads, hd, generator=g).to(dtype),
               torch.randn(nb, bs, heads, hd, generator=g).to(dtype)) for _ in range(layers)]
    pool = HostKVPool(caches, num_slots=10, device=torch.device("cpu"), chunk_slots=[3, 4, 3])   # runs cross chunks
    assert pool.bytes_per_slot == 2 * layers * bs * heads * hd * caches[0][0].element_size()
    rng = random.Random(1)
    saved_blocks = rng.sample(range(1, nb), 7)
    slots = [6, 7, 8, 2, 0, 1, 5]                           # runs and single slots
    want = {s: [(k[b].clone(), v[b].clone()) for k, v in caches] for b, s in zip(saved_blocks, slots)}
    pool.transfer(list(zip(saved_blocks, slots)), [], wait=False)
    for k, v in caches:                                      # the GPU pool is overwritten meanwhile
        k.normal_(generator=g)
        v.normal_(generator=g)
    before = [(k.clone(), v.clone()) for k, v in caches]
    targets = rng.sample(range(1, nb), 5)
    back = [slots[i] for i in (4, 0, 1, 6, 3)]
    pool.transfer([], list(zip(targets, back)), wait=False)
    for j, (k, v) in enumerate(caches):
        for b in range(nb):
            if b in targets:
                wk, wv = want[back[targets.index(b)]][j]
            else:
                wk, wv = before[j]
                wk, wv = wk[b], wv[b]
            assert torch.equal(k[b], wk) and torch.equal(v[b], wv), (j, b)


def test_save_and_load_in_one_step_saves_first() -> None:
    """A block evicted (saved) and refilled from another slot in the same step keeps the saved bytes."""
    caches = [(torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 1, 3) + 100 * i,
               -torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 1, 3)) for i in range(2)]
    pool = HostKVPool(caches, num_slots=4, device=torch.device("cpu"))
    pool.transfer([(2, 0)], [], wait=False)
    old2 = [(k[2].clone(), v[2].clone()) for k, v in caches]
    old1 = [(k[1].clone(), v[1].clone()) for k, v in caches]
    pool.transfer([(1, 3)], [(1, 0)], wait=False)            # save block 1 to slot 3, then load slot 0 into it
    pool.transfer([], [(2, 3)], wait=False)
    for (k, v), (k2, v2), (k1, v1) in zip(caches, old2, old1):
        assert torch.equal(k[1], k2) and torch.equal(v[1], v2)
        assert torch.equal(k[2], k1) and torch.equal(v[2], v1)
