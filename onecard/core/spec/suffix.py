"""Suffix-decoding drafts: vLLM's `method: "suffix"` (Arctic Inference's SuffixDecodingCache), in Python.

Two depth-bounded suffix trees (`suffix_tree.py`, depth = suffix_decoding_max_tree_depth):
- a local tree per request over its prompt + output so far;
- one global tree over the outputs of the last `max_cached_requests` requests, running ones included
  (their outputs enter it as they are generated, as in Arctic Inference); when a new request takes a slot
  beyond the limit, the oldest-started one is evicted (FIFO, as Arctic). 0 turns the global tree off.
A proposal takes the last `depth` tokens as the pattern and asks each tree for its best path draft: every
match length m in 1..len(pattern)-1, at most min(k, floor(m * max_spec_factor)) tokens, following the most
frequent continuation while the product of count(child)/count(node) stays >= min_token_prob; the draft with
the highest sum of those probabilities wins (a longer match on a tie; the local tree unless the global one
scores strictly higher). Ties between children go to the smaller token id (Arctic's depend on a hash map's
order).

Where the output starts: the drafter is not told the prompt length, so it takes the longest prefix passed
to `observe()` before the request's first `propose()`, and at least all but the last token of that first
`propose()` (the engine proposes right after the prefill's sampled token). Only the output goes to the
global tree.

Cost per call: every token not seen before is appended to the local tree and, if it is output, to the
global one (O(depth) node operations each); a proposal then costs O(depth * (depth + k)) node operations
however long the prompt is. Evicting a cached output costs O(depth) per token of it, paid by the call that
evicts. `finish(req_id, None)` (abort) drops the request's local tree and its output from the global tree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from onecard.core.spec.common import as_ints, check_int
from onecard.core.spec.suffix_tree import SuffixTree


@dataclass(slots=True)
class _Request:
    tree: SuffixTree
    seen: int = 0  # tokens in the local tree
    last: int = -1  # tokens[seen - 1]
    observed: int = 0  # the longest prefix observe() showed before the first propose()
    prompt_len: int | None = None  # decided at the first propose()
    pushed: int = 0  # output tokens appended to the global tree
    seq_id: int | None = None  # its sequence in the global tree while cached
    tail: list[int] = field(default_factory=list)  # the last `depth` tokens, the next pattern


class SuffixDrafter:
    """vLLM-compatible suffix decoding; see the module docstring."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ):
        self.k = check_int("num_speculative_tokens", num_speculative_tokens, 1)
        self.depth = check_int("suffix_decoding_max_tree_depth", max_tree_depth, 1)
        self.max_cached = check_int("suffix_decoding_max_cached_requests", max_cached_requests, 0)
        if isinstance(max_spec_factor, bool) or not isinstance(max_spec_factor, int | float) or not (
            max_spec_factor >= 0
        ):
            raise ValueError(f"suffix_decoding_max_spec_factor={max_spec_factor!r} must be a number >= 0")
        if isinstance(min_token_prob, bool) or not isinstance(min_token_prob, int | float) or not (
            0 <= min_token_prob <= 1
        ):
            raise ValueError(f"suffix_decoding_min_token_prob={min_token_prob!r} must be in [0, 1]")
        self.spec_factor = float(max_spec_factor)
        self.min_prob = float(min_token_prob)
        self.global_tree = SuffixTree(self.depth)
        self._reqs: dict[str, _Request] = {}
        self._cached: OrderedDict[str, int] = OrderedDict()  # req_id -> global seq id, oldest start first
        self._next_seq = 0

    @property
    def ops(self) -> int:
        """Node operations done so far, all trees together (the bounded-work tests read it)."""
        return self.global_tree.ops + sum(r.tree.ops for r in self._reqs.values())

    @property
    def cached_requests(self) -> list[str]:
        """Request ids whose outputs are in the global tree, oldest first."""
        return list(self._cached)

    # -- the Drafter interface -------------------------------------------------------------------------
    def observe(self, req_id: str, tokens: Sequence[int]) -> None:
        req = self._sync(req_id, tokens)
        if req.prompt_len is None:
            req.observed = max(req.observed, len(tokens))
        else:
            self._push_output(req_id, req, tokens)

    def propose(self, req_id: str, tokens: Sequence[int], max_k: int) -> list[int]:
        req = self._sync(req_id, tokens)
        if req.prompt_len is None:
            self._start_output(req_id, req, max(req.observed, len(tokens) - 1))
        self._push_output(req_id, req, tokens)
        k = min(max_k, self.k)
        if k <= 0 or not req.tail:
            return []
        draft = req.tree.speculate_tail(0, k, self.spec_factor, self.min_prob)
        if self._cached:
            other = self.global_tree.speculate(req.tail, k, self.spec_factor, self.min_prob)
            if other.score > draft.score:
                draft = other
        return draft.tokens

    def finish(self, req_id: str, tokens: Sequence[int] | None) -> None:
        req = self._reqs.get(req_id)
        if tokens is None:
            self._reqs.pop(req_id, None)
            seq_id = self._cached.pop(req_id, None)
            if seq_id is not None:
                self.global_tree.remove(seq_id)
            return
        if req is None:
            return
        if req.prompt_len is None and req.observed:
            self._start_output(req_id, req, req.observed)
        if req.prompt_len is not None:
            # The tokens generated since the last call still belong to the cached output.
            tokens = as_ints(tokens)
            if len(tokens) >= req.seen:
                self._push_output(req_id, req, tokens)
        del self._reqs[req_id]

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _sync(self, req_id: str, tokens: Sequence[int]) -> _Request:
        """Append the tokens not seen before to the request's local tree (a new request starts one)."""
        req = self._reqs.get(req_id)
        n_tok = len(tokens)
        if req is None or n_tok < req.seen or (req.seen and int(tokens[req.seen - 1]) != req.last):
            if req is not None or req_id in self._cached:
                self.finish(req_id, None)  # a broken append-only rule, or a reused id: start over
            req = self._reqs[req_id] = _Request(tree=SuffixTree(self.depth))
        if n_tok > req.seen:
            new = as_ints(tokens[req.seen :])
            req.tree.extend(0, new)
            req.tail = (req.tail + new)[-self.depth :]
            req.seen, req.last = n_tok, new[-1]
        return req

    def _start_output(self, req_id: str, req: _Request, prompt_len: int) -> None:
        req.prompt_len = prompt_len
        if self.max_cached == 0:
            return
        req.seq_id = self._next_seq
        self._next_seq += 1
        self._cached[req_id] = req.seq_id
        while len(self._cached) > self.max_cached:
            old_id, old_seq = self._cached.popitem(last=False)
            self.global_tree.remove(old_seq)
            old = self._reqs.get(old_id)
            if old is not None:
                old.seq_id = None  # still running: its output stops going to the global tree

    def _push_output(self, req_id: str, req: _Request, tokens: Sequence[int]) -> None:
        start = req.prompt_len + req.pushed
        if start >= len(tokens):
            return
        new = as_ints(tokens[start:])
        req.pushed += len(new)
        if req.seq_id is not None and self._cached.get(req_id) == req.seq_id:
            self.global_tree.extend(req.seq_id, new)
