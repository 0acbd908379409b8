"""Chained block hashes: determinism, chaining, extra keys, incremental == from-scratch."""
from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from array import array

from onecard.core.block_hash import hash_block, update_block_hashes
from onecard.core.request import Request
from onecard.sampling_params import SamplingParams


def _req(tokens: list[int]) -> Request:
    return Request("r", list(tokens), SamplingParams(max_tokens=4), 0.0)


def _reference_hashes(tokens: list[int], bs: int) -> list[int]:
    """An independent spelling of the chain: sha256(marker | parent | int64 tokens) per full block."""
    out, parent = [], b"\x00" * 33
    for i in range(len(tokens) // bs):
        digest = hashlib.sha256(parent + array("q", tokens[i * bs:(i + 1) * bs]).tobytes()).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = b"\x01" + digest
    return out


def test_matches_independent_reference() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(53)]
    assert update_block_hashes(_req(tokens), 8) == _reference_hashes(tokens, 8)


def test_deterministic_and_sensitive() -> None:
    a = hash_block(None, (1, 2, 3, 4))
    assert a == hash_block(None, (1, 2, 3, 4))
    assert a != hash_block(None, (1, 2, 3, 5))
    assert a != hash_block(None, (1, 2, 4, 3))
    assert a != hash_block(0, (1, 2, 3, 4))              # a parent of 0 is not "no parent"
    assert a != hash_block(None, (1, 2, 3, 4), ("lora", 1))
    assert hash_block(None, (1, 2, 3, 4), ("lora", 1)) != hash_block(None, (1, 2, 3, 4), ("lora", 2))


def test_change_in_early_block_changes_all_later_hashes() -> None:
    bs = 4
    tokens = list(range(40))
    base = update_block_hashes(_req(tokens), bs)
    changed = list(tokens)
    changed[1] = 999                                     # inside block 0
    other = update_block_hashes(_req(changed), bs)
    assert len(base) == len(other) == 10
    assert all(x != y for x, y in zip(base, other))
    changed2 = list(tokens)
    changed2[21] = 999                                   # inside block 5: blocks 0..4 keep their hashes
    other2 = update_block_hashes(_req(changed2), bs)
    assert other2[:5] == base[:5] and all(x != y for x, y in zip(base[5:], other2[5:]))


def test_incremental_equals_from_scratch() -> None:
    rng = random.Random(1)
    bs = 4
    req = _req([rng.randrange(1000) for _ in range(6)])
    assert len(update_block_hashes(req, bs)) == 1        # the partial second block is not hashed
    for _ in range(30):
        req.append_output_token(rng.randrange(1000))
        update_block_hashes(req, bs)
        assert req.block_hashes == _reference_hashes(req.all_token_ids, bs)


def test_max_blocks_limits_work() -> None:
    req = _req(list(range(32)))
    assert len(update_block_hashes(req, 4, max_blocks=3)) == 3
    assert update_block_hashes(req, 4) == _reference_hashes(list(range(32)), 4)


def test_stable_across_processes() -> None:
    code = "from onecard.core.block_hash import hash_block; print(hash_block(None, (7, 8, 9), ('x', 1)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".")
    assert int(out.stdout) == hash_block(None, (7, 8, 9), ("x", 1))
