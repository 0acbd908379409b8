"""Prompt-lookup (n-gram) drafts: vLLM's `method: "ngram"`, same semantics, incremental index.

Semantics (vLLM's `_find_longest_matched_ngram_and_propose_tokens`): over the request's own tokens t[0..L-1],
take the largest n in [prompt_lookup_min, prompt_lookup_max] whose suffix n-gram t[L-n..L-1] also occurs
ending at an earlier position e <= L-2 (an occurrence may overlap the suffix itself); of those occurrences
the EARLIEST wins; propose t[e+1 .. e+k] (fewer when the tokens run out). No match (or L < min) gives [].

Cost: one dict per n maps each n-gram to the first position it ended at; a call indexes only the positions
that became eligible since the last call (max - min + 1 dict writes each), then makes at most max - min + 1
lookups of tuples of <= max tokens. Nothing depends on the prompt's length. Memory: one entry per distinct
n-gram per n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from onecard.core.spec.common import as_ints, check_int


@dataclass(slots=True)
class _Request:
    seen: int = 0  # tokens shown so far
    last: int = -1  # tokens[seen - 1], to notice a caller that broke the append-only rule
    indexed_end: int = 0  # n-grams ending at positions < indexed_end are in `index`
    index: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # [n - min_n]: n-gram -> first end


class NgramDrafter:
    """vLLM-compatible n-gram prompt lookup; see the module docstring."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 5, prompt_lookup_max: int = 5):
        self.k = check_int("num_speculative_tokens", num_speculative_tokens, 1)
        self.min_n = check_int("prompt_lookup_min", prompt_lookup_min, 1)
        self.max_n = check_int("prompt_lookup_max", prompt_lookup_max, 1)
        if self.min_n > self.max_n:
            raise ValueError(f"prompt_lookup_min={self.min_n} must be <= prompt_lookup_max={self.max_n}")
        self._reqs: dict[str, _Request] = {}
        # Work counters (dict writes while indexing, dict lookups while proposing): the tests check the
        # bounded-work contract with them instead of with wall time.
        self.index_ops = 0
        self.query_ops = 0

    # -- the Drafter interface -------------------------------------------------------------------------
    def observe(self, req_id: str, tokens: Sequence[int]) -> None:
        self._sync(req_id, tokens)

    def propose(self, req_id: str, tokens: Sequence[int], max_k: int) -> list[int]:
        req = self._sync(req_id, tokens)
        n_tok = len(tokens)
        k = min(max_k, self.k)
        if k <= 0 or n_tok < self.min_n:
            return []
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            self.query_ops += 1
            end = req.index[n - self.min_n].get(tuple(as_ints(tokens[n_tok - n :])))
            if end is not None:
                return as_ints(tokens[end + 1 : end + 1 + k])
        return []

    def finish(self, req_id: str, tokens: Sequence[int] | None) -> None:
        self._reqs.pop(req_id, None)

    # -- indexing --------------------------------------------------------------------------------------
    def _sync(self, req_id: str, tokens: Sequence[int]) -> _Request:
        """Index every n-gram that ends at a position <= len(tokens) - 2 and is not indexed yet."""
        req = self._reqs.get(req_id)
        n_tok = len(tokens)
        if req is None or n_tok < req.seen or (req.seen and int(tokens[req.seen - 1]) != req.last):
            req = self._reqs[req_id] = _Request(index=[{} for _ in range(self.min_n, self.max_n + 1)])
        if n_tok:
            req.seen, req.last = n_tok, int(tokens[n_tok - 1])
        end = n_tok - 1  # the n-gram ending at the last token is the one being looked up, not a match
        if end <= req.indexed_end:
            return req
        start = req.indexed_end
        # Tokens needed: the n-1 before `start` for the longest n-gram, through position end - 1.
        base = max(0, start - self.max_n + 1)
        seg = as_ints(tokens[base:end])
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n - 1)  # positions whose n-gram fits inside the tokens
            if first >= end:
                continue
            lo = first - n + 1 - base
            cols = [seg[lo + j : lo + j + end - first] for j in range(n)]
            setdefault = req.index[n - self.min_n].setdefault
            for key, pos in zip(zip(*cols), range(first, end)):
                setdefault(key, pos)  # the earliest occurrence wins, as in vLLM
            self.index_ops += end - first
        req.indexed_end = end
        return req
