"""A depth-bounded suffix tree with occurrence counts, built online, for suffix-decoding drafts.

What it represents: for a set of token sequences and a depth D, every string P with |P| <= D has
count(P) = the number of (sequence, start) pairs where P occurs. The tree is the trie of all those strings
with single-child chains of equal count compressed into one edge; an edge's label is a slice of some
token list (`buf[start:start + length]`). Within an edge the count is constant, so walking it needs no
arithmetic.

Online construction: a sequence keeps the nodes where its last D-1 suffixes end ("active" suffixes, longest
first); appending a token extends each of them by one edge step and starts a new empty suffix at the root,
so appending costs O(D) node operations, never more. Removing a sequence walks its suffixes once (O(D) per
token again) and copies any edge label that still pointed into its token list, so an evicted sequence's
tokens are not kept alive by the tree.

Queries: `match(pattern)` finds where `pattern` ends (or None); `walk(...)` follows the most frequent child
(ties: the smaller token id) while the running probability count(child)/count(node) product stays >=
min_prob. Each node caches its best child; a count that drops (removal) marks it stale and it is recomputed
on the next walk through that node.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class _Node:
    __slots__ = ("best", "buf", "children", "count", "length", "parent", "stale", "start")

    def __init__(self, parent: _Node | None, buf: list[int], start: int, length: int, count: int):
        self.parent = parent
        self.buf = buf  # the edge label is buf[start:start + length]
        self.start = start
        self.length = length
        self.count = count
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None  # the child a walk takes, unless `stale`
        self.stale = False


def _beats(a: _Node, b: _Node) -> bool:
    """Does child a win over child b (higher count, then smaller token id)?"""
    return a.count > b.count or (a.count == b.count and a.buf[a.start] < b.buf[b.start])


def _promote(node: _Node, child: _Node) -> None:
    """`child` of `node` gained count (or was just created): keep the cached best child right."""
    best = node.best
    if not node.stale and (best is None or (best is not child and _beats(child, best))):
        node.best = child


def _best_child(node: _Node) -> _Node | None:
    if node.stale:
        node.stale = False
        node.best = None
        for child in node.children.values() if node.children else ():
            if node.best is None or _beats(child, node.best):
                node.best = child
    return node.best


@dataclass(slots=True)
class _Seq:
    tokens: list[int] = field(default_factory=list)
    active: list[_Node] = field(default_factory=list)  # where the last <= D-1 suffixes end, longest first


@dataclass(slots=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0  # the sum of each drafted token's estimated probability
    match_len: int = 0


class SuffixTree:
    """Counts of every string of length <= depth in a set of sequences; see the module docstring."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node(None, [], 0, 0, 0)  # root.count = number of suffix starts (tokens)
        self.seqs: dict[int, _Seq] = {}
        self.ops = 0  # node operations done so far (the bounded-work tests read it)

    # -- construction ------------------------------------------------------------------------------------
    def extend(self, seq_id: int, tokens: list[int]) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = _Seq()
        for token in tokens:
            self._append(seq, token)

    def _append(self, seq: _Seq, token: int) -> None:
        root = self.root
        toks = seq.tokens
        pos = len(toks)
        toks.append(token)
        active = seq.active
        active.append(root)
        root.count += 1
        if len(active) > self.depth:
            active.pop(0)  # that suffix reached depth D: it stays where it ends
        self.ops += len(active)
        # Counts never decrease from a longer suffix to a shorter one, so the suffixes that occur only once
        # come first; each is alone on its leaf and just lengthens its edge over the new token.
        first = 0
        for node in active:
            if node.count != 1 or node is root:
                break
            node.buf, node.start = toks, pos - node.length
            node.length += 1
            first += 1
        for i in range(first, len(active)):
            node = active[i]
            children = node.children
            child = children.get(token) if children else None
            if child is None:
                if node is not root and node.count == 1:
                    # Only this suffix runs through this leaf: lengthen its edge over the new token.
                    node.buf, node.start = toks, pos - node.length
                    node.length += 1
                else:
                    leaf = _Node(node, toks, pos, 1, 1)
                    if children is None:
                        children = node.children = {}
                    children[token] = leaf
                    best = node.best
                    if not node.stale and (best is None or (best.count == 1 and best.buf[best.start] > token)):
                        node.best = leaf
                    active[i] = leaf
            elif node is not root and node.count == child.count + 1:
                # This suffix is the only one ending at `node` and every other goes on to `child`: after the
                # step the two would carry equal counts, so they become one edge.
                if child.length == 1:
                    parent = node.parent
                    key = node.buf[node.start]
                    child.buf, child.start, child.length = toks, pos - node.length, node.length + 1
                    child.count += 1
                    child.parent = parent
                    parent.children[key] = child
                    if parent.best is node:
                        parent.best = child
                    active[i] = child
                else:
                    node.buf, node.start = toks, pos - node.length
                    node.length += 1
                    del children[token]
                    child.start += 1
                    child.length -= 1
                    children[child.buf[child.start]] = child
                    node.best, node.stale = child, False
            elif child.length == 1:
                count = child.count = child.count + 1
                child.buf, child.start = toks, pos
                best = node.best
                if not node.stale and best is not child and (
                    best is None or count > best.count or (count == best.count and token < best.buf[best.start])
                ):
                    node.best = child
                active[i] = child
            else:
                # Split `child` after its first token; the new node carries this suffix as well.
                mid = _Node(node, toks, pos, 1, child.count + 1)
                child.start += 1
                child.length -= 1
                child.parent = mid
                mid.children = {child.buf[child.start]: child}
                mid.best = child
                children[token] = mid
                if node.best is child:
                    node.best = mid
                else:
                    _promote(node, mid)
                active[i] = mid

    def remove(self, seq_id: int) -> None:
        """Take a sequence's occurrences out of every count; O(depth) node operations per token."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        toks = seq.tokens
        n_tok = len(toks)
        root = self.root
        for s in range(n_tok):
            root.count -= 1
            node = root
            i, end = s, min(n_tok, s + self.depth)
            while i < end:
                child = node.children[toks[i]]
                self.ops += 1
                child.count -= 1
                if node.best is child:
                    node.stale = True
                if child.count == 0:
                    del node.children[toks[i]]
                    break
                if child.buf is toks:
                    # Keep the label, not the evicted token list.
                    child.buf, child.start = toks[child.start : child.start + child.length], 0
                i += child.length
                node = child
            if node is not root and node.children and len(node.children) == 1:
                (only,) = node.children.values()
                if only.count == node.count:
                    self._merge_into_child(node, only)
        if root.children is not None and not root.children:
            root.children = None

    @staticmethod
    def _merge_into_child(node: _Node, child: _Node) -> None:
        """`node` has one child of equal count: the child takes its place with the joined label."""
        parent = node.parent
        key = node.buf[node.start]
        if child.buf is node.buf and child.start == node.start + node.length:
            child.start = node.start
        else:
            child.buf = node.buf[node.start : node.start + node.length] + list(
                child.buf[child.start : child.start + child.length]
            )
            child.start = 0
        child.length += node.length
        child.parent = parent
        parent.children[key] = child
        if parent.best is node:
            parent.best = child

    # -- queries -----------------------------------------------------------------------------------------
    def match(self, pattern: list[int]) -> tuple[_Node, int] | None:
        """(node, tokens of its edge consumed) where `pattern` ends, or None when it does not occur."""
        node, j, used, n = self.root, 0, 0, len(pattern)
        while j < n:
            self.ops += 1
            children = node.children
            child = children.get(pattern[j]) if children else None
            if child is None:
                return None
            take = min(child.length, n - j)
            if child.buf[child.start : child.start + take] != pattern[j : j + take]:
                return None
            node, j, used = child, j + take, take
        return node, used

    def walk(self, node: _Node, used: int, max_tokens: int, min_prob: float) -> Draft:
        """Follow the most frequent continuation from inside `node`'s edge, as suffix decoding drafts."""
        draft = Draft()
        prob = 1.0
        while len(draft.tokens) < max_tokens:
            self.ops += 1
            if used < node.length:
                take = min(node.length - used, max_tokens - len(draft.tokens))
                draft.tokens.extend(node.buf[node.start + used : node.start + used + take])
                for _ in range(take):
                    draft.score += prob  # token by token, so scores compare exactly as a reference's
                used += take
                continue
            child = _best_child(node)
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            node, used = child, 0
        return draft

    def speculate(self, pattern: list[int], max_tokens: int, spec_factor: float, min_prob: float) -> Draft:
        """Arctic Inference's path speculation: try every match length 1..len(pattern)-1; the highest score
        wins, a longer match on a tie. The draft for match length m is at most floor(m * spec_factor)."""
        n = len(pattern)
        return self._speculate((self.match(pattern[n - m :]) for m in range(1, n)), max_tokens, spec_factor,
                               min_prob)

    def speculate_tail(self, seq_id: int, max_tokens: int, spec_factor: float, min_prob: float) -> Draft:
        """`speculate` with the pattern = the last `depth` tokens of sequence `seq_id` itself: its active
        suffixes already end where each match length ends, so nothing is matched from the root."""
        active = self.seqs[seq_id].active
        return self._speculate(((active[-m], active[-m].length) for m in range(1, len(active))), max_tokens,
                               spec_factor, min_prob)

    def _speculate(self, matches, max_tokens: int, spec_factor: float, min_prob: float) -> Draft:
        """`matches` yields, for m = 1, 2, ..., where the pattern's last m tokens end (None: no match)."""
        best = Draft()
        for m, found in enumerate(matches, 1):
            if found is None:
                break  # a longer suffix cannot occur either
            cap = min(max_tokens, int(m * spec_factor + 1e-6))
            if cap < best.score:
                continue  # cannot win, not even the tie
            draft = self.walk(found[0], found[1], cap, min_prob)
            if draft.score >= best.score:
                draft.match_len = m
                best = draft
        return best
