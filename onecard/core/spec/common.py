"""Small helpers every drafter shares: option checks and token lists as Python ints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_int(name: str, value: Any, lowest: int) -> int:
    """`value` as an int >= lowest, else ValueError naming the key (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name}={value!r} must be an integer >= {lowest}")
    return value


def as_ints(tokens: Sequence[int]) -> list[int]:
    """Python ints from a list, tuple or numpy array slice (numpy scalars would leak into drafts)."""
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tokens]
