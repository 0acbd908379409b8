"""Chained hashes of full KV-cache blocks (prefix caching). Pure Python, no torch.

Contract:
- ``hash_block(parent_hash, token_ids, extra_keys)`` hashes ONE full block: its token ids, the hash of the
  block before it (``None`` for the first block) and optional extra keys (anything that changes the KV of the
  same tokens, e.g. a LoRA id or a cache salt; they must have a deterministic ``repr``). Because the parent
  hash is an input, a change in any earlier token changes every later block's hash.
- The hash is SHA-256 (as an int, 256 bits): stable across processes and collision-resistant, so an
  attacker cannot craft a prompt that reads another request's KV. The KV-cache manager still checks token
  equality (and the chain) on a hit.
- ``update_block_hashes(request, block_size, ...)`` appends the hashes of blocks of ``request.all_token_ids``
  that have become full since the last call, to ``request.block_hashes``. Incremental: a decode step costs
  nothing unless a block just filled (then one hash).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from onecard.core.request import Request

HashFn = Callable[[int | None, tuple[int, ...], tuple | None], int]

_NO_PARENT = b"\x00" * 33     # a marker byte keeps "no parent" apart from a parent hash of 0


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> int:
    """SHA-256 of (marker + parent hash, token ids as int64, repr(extra_keys)) as a 256-bit int."""
    h = hashlib.sha256(_NO_PARENT if parent_hash is None else b"\x01" + parent_hash.to_bytes(32, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(b"\x01")   # a separator, so keys can never alias token bytes
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


def update_block_hashes(request: Request, block_size: int, extra_keys: tuple | None = None,
                        hash_fn: HashFn = hash_block, max_blocks: int | None = None) -> list[int]:
    """Extend ``request.block_hashes`` to cover every full block (at most ``max_blocks``); return it."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    target = len(tokens) // block_size
    if max_blocks is not None and max_blocks < target:
        target = max_blocks
    i = len(hashes)
    parent = hashes[-1] if hashes else None
    while i < target:
        parent = hash_fn(parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra_keys)
        hashes.append(parent)
        i += 1
    return hashes
