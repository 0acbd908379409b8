"""Paged KV-cache block pool with ref counts and prefix caching (vLLM v1 semantics). Pure Python, no torch.

Contract:
- Block ids are ``1 .. num_blocks-1``; block 0 is a reserved null block that is never handed out (the runner
  may point padding rows of a block table at it). Counts and ``usage`` exclude it.
- A request owns an ordered list of blocks covering its computed tokens plus the ones scheduled this step.
- ``get_computed_blocks(request)`` -> ``(blocks, num_computed_tokens)``: the longest chain of cached FULL
  blocks matching the request's tokens (hash hit AND token equality), never covering the last token (there
  must be something to compute, to get logits). Pass ``blocks`` to ``allocate_slots`` in the same step.
- ``allocate_slots(request, num_new_tokens, new_computed_blocks)`` -> all the request's block ids (a copy), or
  ``None`` when the free pool is too small (nothing changes then). It takes the hit blocks (ref count + 1,
  reviving free ones), adds fresh blocks for ``request.num_computed_tokens + hits + num_new_tokens`` tokens,
  and registers in the prefix cache every block that is full once this step's tokens are written. A sibling
  admitted later in the same step can hit those blocks: each layer stores all new KV before attention.
- ``trim(request, num_tokens)`` drops the blocks beyond the first ``num_tokens`` tokens (rejected drafts' slots).
- ``free(request)`` drops one reference per block, in reverse order, so a request's tail is evicted first.
  Free blocks form an LRU queue (least recently freed at the head; uncached blocks go to the head at once);
  a free block keeps its hash until it is reused, so a later request can revive it.
- Host tier (``num_host_blocks > 0``, prefix caching on): a cached block evicted for reuse is booked into the
  host tier (core/host_tier.py) and a copy (gpu block, host slot) is queued; the lookup goes on past a GPU miss
  into the host tier, and such a hit (``HostHit``) in ``new_computed_blocks`` gets a fresh block, registered in
  the prefix cache at once, with a copy (gpu block, host slot) queued back. ``take_transfers()`` (once per
  scheduled step) returns ``KVTransfers``: the copies to host, then from host, in that order (a block evicted
  and refilled in one step is saved first), and ``wait``: whether any of their GPU blocks was freed since the
  last ``take_transfers()``, so a step still in flight may use it and the copies must queue behind that step.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from onecard.core.block_hash import HashFn, hash_block, update_block_hashes
from onecard.core.host_tier import HostKVTier
from onecard.core.request import Request


class KVBlock:
    """One block of the pool. ``block_hash``/``token_ids`` are set while the block is in the prefix cache."""

    __slots__ = ("block_hash", "block_id", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class HostHit:
    """A block of a request's prefix found in the host tier (a GPU miss): loaded back at allocation."""

    __slots__ = ("block_hash", "slot", "token_ids")

    def __init__(self, slot: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        self.slot = slot
        self.block_hash = block_hash
        self.token_ids = token_ids

    def __repr__(self) -> str:
        return f"HostHit(slot={self.slot})"


@dataclass(slots=True)
class KVTransfers:
    """One step's copies between the GPU pool and the host tier, as (gpu block, host slot) pairs."""

    to_host: list[tuple[int, int]] = field(default_factory=list)
    from_host: list[tuple[int, int]] = field(default_factory=list)
    wait: bool = False                   # a GPU block here may be used by the step in flight: queue behind it


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 hash_fn: HashFn = hash_block, num_host_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least 2 blocks (block 0 is reserved).")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # LRU free queue: the head (first item) is the next block to hand out / evict.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, KVBlock] = {}           # block hash -> the block holding it
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}
        self._req_num_cached: dict[str, int] = {}       # leading blocks already registered in the cache
        self.prefix_cache_queries = 0                   # tokens looked up at admission (cumulative)
        self.prefix_cache_hits = 0                      # tokens found (cumulative)
        self.host: HostKVTier | None = (HostKVTier(num_host_blocks)
                                        if num_host_blocks > 0 and enable_prefix_caching else None)
        self._transfers = KVTransfers()
        self._freed_since_take: set[int] = set()        # block ids freed since the last take_transfers()
        self.host_queries = 0                           # tokens looked up with the host tier on (cumulative)
        self.host_hits = 0                              # tokens found in the host tier (cumulative)
        self.blocks_to_host = 0                         # blocks copied GPU -> host (cumulative)
        self.blocks_from_host = 0                       # blocks copied host -> GPU (cumulative)

    # ------------------------------------------------------------------ queries
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._req_block_ids.get(request_id, ()))

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock | HostHit], int]:
        """Longest run of cached full blocks equal to the request's leading tokens (never all its tokens);
        with a host tier each block is looked up on the GPU first, then on the host (``HostHit``)."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs     # keep >= 1 token to compute
        if max_blocks <= 0:
            return [], 0
        hashes = update_block_hashes(request, bs, hash_fn=self.hash_fn)
        tokens = request.all_token_ids
        cached = self._cached
        host = self.host
        hits: list[KVBlock | HostHit] = []
        for i in range(max_blocks):
            h = hashes[i]
            block = cached.get(h)
            toks = tuple(tokens[i * bs:(i + 1) * bs])
            # A hash hit is trusted only if the tokens match too (defence against collisions).
            if block is not None and block.token_ids == toks:
                hits.append(block)
                continue
            slot = None if host is None or block is not None else host.lookup(h, toks)
            if slot is None:
                break
            hits.append(HostHit(slot, h, toks))
        return hits, len(hits) * bs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, as in vLLM."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()
        if self.host is not None:
            self.host.reset()
        return True

    # ------------------------------------------------------------------ host tier
    def take_transfers(self) -> KVTransfers:
        """This step's copies (see the module docstring); the next step starts with none."""
        t = self._transfers
        if self.host is not None:
            freed = self._freed_since_take
            if freed:
                t.wait = any(g in freed for g, _ in t.to_host) or any(g in freed for g, _ in t.from_host)
                freed.clear()
            self.host.unpin_all()
            self.blocks_to_host += len(t.to_host)
            self.blocks_from_host += len(t.from_host)
            self._transfers = KVTransfers()
        return t

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock | HostHit] | None = None) -> list[int] | None:
        rid = request.request_id
        ids = self._req_block_ids.get(rid)
        if ids is not None and not new_computed_blocks:
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total <= len(ids) * self.block_size:
                # Fast path (decode inside a block): only a block that just filled may need caching.
                if self.enable_prefix_caching and num_total // self.block_size > self._req_num_cached[rid]:
                    self._cache_full_blocks(request, self._req_blocks[rid], num_total)
                return ids[:]
        return self._allocate(request, num_new_tokens, new_computed_blocks or ())

    def _allocate(self, request: Request, num_new_tokens: int,
                  computed: list[KVBlock | HostHit] | tuple) -> list[int] | None:
        rid = request.request_id
        bs = self.block_size
        blocks = self._req_blocks.get(rid)
        num_total = request.num_computed_tokens + len(computed) * bs + num_new_tokens
        held = len(blocks) if blocks is not None else 0
        num_new_blocks = -(-num_total // bs) - held - len(computed)
        free = self._free
        num_host = sum(1 for b in computed if type(b) is HostHit)
        num_revived = sum(1 for b in computed if type(b) is KVBlock and b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived + num_host > len(free):
            return None

        first = blocks is None
        if first:
            blocks, ids = [], []
            self._req_blocks[rid] = blocks
            self._req_block_ids[rid] = ids
            self._req_num_cached[rid] = len(computed)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += (len(computed) - num_host) * bs
                if self.host is not None:
                    self.host_queries += request.num_tokens
                    self.host_hits += num_host * bs
        else:
            ids = self._req_block_ids[rid]
        if num_host:
            host = self.host
            for b in computed:                         # before any eviction below can book a slot
                if type(b) is HostHit:
                    host.pin(b.slot)
                    host.touch(b.block_hash)
            # GPU hits leave the free queue first, so the fresh blocks below never evict one of them
            for block in computed:
                if type(block) is KVBlock:
                    if block.ref_cnt == 0:
                        del free[block.block_id]
                    block.ref_cnt += 1
            from_host = self._transfers.from_host
            for b in computed:
                if type(b) is HostHit:
                    block = self._pop_free()
                    block.block_hash = b.block_hash
                    block.token_ids = b.token_ids
                    self._cached[b.block_hash] = block
                    from_host.append((block.block_id, b.slot))
                else:
                    block = b
                blocks.append(block)
                ids.append(block.block_id)
        else:
            for block in computed:
                if block.ref_cnt == 0:
                    del free[block.block_id]
                block.ref_cnt += 1
                blocks.append(block)
                ids.append(block.block_id)
        for _ in range(num_new_blocks):
            block = self._pop_free()
            blocks.append(block)
            ids.append(block.block_id)
        if self.enable_prefix_caching and num_total // bs > self._req_num_cached[rid]:
            self._cache_full_blocks(request, blocks, num_total)
        return list(ids)

    def _pop_free(self) -> KVBlock:
        """The least recently freed block, evicted from the prefix cache (to the host tier, if any)."""
        _, block = self._free.popitem(last=False)
        h = block.block_hash
        if h is not None:
            if self._cached.get(h) is block:
                del self._cached[h]
                if self.host is not None:
                    slot = self.host.store(h, block.token_ids)
                    if slot is not None:
                        self._transfers.to_host.append((block.block_id, slot))
            block.block_hash = None
            block.token_ids = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_total: int) -> None:
        bs = self.block_size
        rid = request.request_id
        num_full = min(num_total, request.num_tokens) // bs
        start = self._req_num_cached[rid]
        hashes = update_block_hashes(request, bs, hash_fn=self.hash_fn, max_blocks=num_full)
        tokens = request.all_token_ids
        cached = self._cached
        for i in range(start, num_full):
            h = hashes[i]
            block = blocks[i]
            # A duplicate of an already-cached block (two requests computed the same tokens) stays private.
            if block.block_hash is None and h not in cached:
                block.block_hash = h
                block.token_ids = tuple(tokens[i * bs:(i + 1) * bs])
                cached[h] = block
        self._req_num_cached[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks beyond the first ``num_tokens`` tokens (speculative decoding: the slots of
        rejected drafts). Those blocks were never registered in the prefix cache (only blocks full of known tokens
        are), so they go to the head of the free queue."""
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        ids = self._req_block_ids[rid]
        freed = self._freed_since_take if self.host is not None else None
        while len(blocks) > keep:
            block = blocks.pop()
            ids.pop()
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
                if freed is not None:
                    freed.add(block.block_id)
        self._req_num_cached[rid] = min(self._req_num_cached[rid], keep)

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op if it has none)."""
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, None)
        self._req_block_ids.pop(rid, None)
        self._req_num_cached.pop(rid, None)
        if not blocks:
            return
        free = self._free
        freed = self._freed_since_take if self.host is not None else None
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block           # tail = most recently freed
                if freed is not None:
                    freed.add(block.block_id)
                if block.block_hash is None:
                    # Nothing to revive: hand it out before any cached block, which keeps hits alive longer.
                    free.move_to_end(block.block_id, last=False)
