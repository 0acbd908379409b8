"""The host-memory tier of the prefix cache: which host slot holds which evicted KV block. Pure Python, no torch.

Contract:
- ``HostKVTier(num_slots)`` books ``num_slots`` block-sized slots of host memory (the runner owns the bytes). An
  entry is one FULL block: its chained block hash (the GPU prefix cache's key) and its token ids (a hit is
  trusted only when the tokens match too). LRU within the budget: ``store`` and a used hit (``touch``) make an
  entry the most recent; a store into a full tier evicts the least recently used entry that is not pinned.
- ``lookup(block_hash, token_ids) -> slot | None`` is a pure query. ``store(block_hash, token_ids) -> slot |
  None`` books a slot for a block the GPU cache evicts: None when the hash is already held (it is refreshed;
  nothing to copy) or when every slot is pinned (the block is dropped: eviction never waits).
- ``pin(slot)``: the slot is read or written by a copy queued in the step being scheduled, so it cannot be
  evicted (and reused) before that step's copies are issued; ``unpin_all()`` at the end of scheduling. So a slot
  appears at most once in a step's copies, and a load never reads a slot that a save of the same step rewrote.
- ``reset()`` forgets every entry. Slots are ``0 .. num_slots-1``; ``num_used + num_free == num_slots`` always.
"""
from __future__ import annotations

from collections import OrderedDict


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: the host tier needs at least one slot.")
        self.num_slots = num_slots
        # block hash -> (slot, token ids); iteration order = LRU order (first = least recently used)
        self._entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._slot_hash: dict[int, int] = {}             # slot -> hash of the entry in it
        self._free: list[int] = list(range(num_slots - 1, -1, -1))   # pop() hands out 0, 1, 2, ... first
        self._pinned: set[int] = set()
        self.num_evicted = 0                              # entries dropped to make room (cumulative)
        self.num_dropped = 0                              # stores refused: every slot pinned (cumulative)

    @property
    def num_used(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return len(self._entries) / self.num_slots

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        entry = self._entries.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return None
        return entry[0]

    def touch(self, block_hash: int) -> None:
        self._entries.move_to_end(block_hash)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def store(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._evict_one()
            if slot is None:
                self.num_dropped += 1
                return None
        self._entries[block_hash] = (slot, token_ids)
        self._slot_hash[slot] = block_hash
        self._pinned.add(slot)                            # written by this step's copies
        return slot

    def _evict_one(self) -> int | None:
        pinned = self._pinned
        for block_hash, (slot, _) in self._entries.items():   # least recently used first
            if slot not in pinned:
                del self._entries[block_hash]
                del self._slot_hash[slot]
                self.num_evicted += 1
                return slot
        return None

    def reset(self) -> None:
        self._entries.clear()
        self._slot_hash.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()

    def slot_of(self, block_hash: int) -> int | None:
        entry = self._entries.get(block_hash)
        return None if entry is None else entry[0]

    def lru_hashes(self) -> list[int]:
        """Entries from least to most recently used (tests, debugging)."""
        return list(self._entries)
