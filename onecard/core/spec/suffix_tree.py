"""A depth-bounded suffix tree with occurrence counts, built online, for suffix-decoding drafts.

What it represents: for a set of token sequences and a depth D, every string P with |P| <= D has
count(P) = the number of (sequence, start) pairs where P occurs. The tree is the trie of all those strings
with single-child chains of equal count compressed into one edge; an edge's label is a slice of some
token list (`buf[start:start + length]`). Within an edge the count is constant, so walking it needs no
arithmetic.

Layout: nodes are int ids into parallel lists (parent, buf, start, length, count, best child) plus one
int -> int children dict per inner node. No Python object per node: the garbage collector, whose full passes
cost time per tracked object, sees a handful of lists (int-only dicts and tuples are untracked), and a node
costs ~150 bytes. Freed ids are reused.

Online construction: a sequence keeps the nodes where its last D-1 suffixes end ("active" suffixes, longest
first); appending a token extends each of them by one edge step and starts a new empty suffix at the root,
so appending costs O(D) node operations, never more. Removing a sequence walks its suffixes once (O(D) per
token again) and copies any edge label that still pointed into its token list into a tuple, so an evicted
sequence's tokens are not kept alive by the tree.

Queries: `match(pattern)` finds where `pattern` ends (or None); `walk(...)` follows the most frequent child
(ties: the smaller token id) while the running probability count(child)/count(node) product stays >=
min_prob. Each node caches its best child; a count that drops (removal) marks it stale and it is recomputed
on the next walk through that node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROOT = 0
_NONE = -1  # no best child (no children)
_STALE = -2  # best child unknown: recompute on the next walk


@dataclass(slots=True)
class _Seq:
    tokens: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)  # where the last <= D-1 suffixes end, longest first


@dataclass(slots=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0  # the sum of each drafted token's estimated probability
    match_len: int = 0


class SuffixTree:
    """Counts of every string of length <= depth in a set of sequences; see the module docstring."""

    def __init__(self, depth: int):
        self.depth = depth
        # Per node id; the root (id 0) has count = number of suffix starts (tokens) and an empty label.
        self.parent: list[int] = [_NONE]
        self.buf: list[list[int] | tuple[int, ...] | None] = [None]  # the edge label is buf[start:start+length]
        self.start: list[int] = [0]
        self.length: list[int] = [0]
        self.count: list[int] = [0]
        self.children: list[dict[int, int] | None] = [None]  # first token of the child's label -> child id
        self.best: list[int] = [_NONE]
        self._free: list[int] = []
        self.seqs: dict[int, _Seq] = {}
        self.ops = 0  # node operations done so far (the bounded-work tests read it)

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    # -- node ids ----------------------------------------------------------------------------------------
    def _new(self, parent: int, buf: list[int], start: int, length: int, count: int) -> int:
        if self._free:
            node = self._free.pop()
            self.parent[node], self.buf[node], self.start[node] = parent, buf, start
            self.length[node], self.count[node] = length, count
            self.children[node], self.best[node] = None, _NONE
            return node
        self.parent.append(parent)
        self.buf.append(buf)
        self.start.append(start)
        self.length.append(length)
        self.count.append(count)
        self.children.append(None)
        self.best.append(_NONE)
        return len(self.count) - 1

    def _release(self, node: int) -> None:
        """Free `node` and everything below it (their counts are 0, or they were merged away)."""
        stack = [node]
        while stack:
            n = stack.pop()
            kids = self.children[n]
            if kids:
                stack.extend(kids.values())
            self.children[n] = self.buf[n] = None
            self.best[n] = _NONE
            self._free.append(n)

    # -- construction ------------------------------------------------------------------------------------
    def extend(self, seq_id: int, tokens: list[int]) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = _Seq()
        for token in tokens:
            self._append(seq, token)

    def _append(self, seq: _Seq, token: int) -> None:
        parent_of, buf, start, length = self.parent, self.buf, self.start, self.length
        count, children_of, best_of = self.count, self.children, self.best
        toks = seq.tokens
        pos = len(toks)
        toks.append(token)
        active = seq.active
        active.append(ROOT)
        count[ROOT] += 1
        if len(active) > self.depth:
            active.pop(0)  # that suffix reached depth D: it stays where it ends
        self.ops += len(active)
        # Counts never decrease from a longer suffix to a shorter one, so the suffixes that occur only once
        # come first; each is alone on its leaf and just lengthens its edge over the new token.
        first = 0
        for node in active:
            if node == ROOT or count[node] != 1:
                break
            buf[node], start[node] = toks, pos - length[node]
            length[node] += 1
            first += 1
        for i in range(first, len(active)):
            node = active[i]
            children = children_of[node]
            child = children.get(token, _NONE) if children else _NONE
            if child == _NONE:
                if node != ROOT and count[node] == 1:
                    buf[node], start[node] = toks, pos - length[node]
                    length[node] += 1
                    continue
                leaf = self._new(node, toks, pos, 1, 1)
                if children is None:
                    children = children_of[node] = {}
                children[token] = leaf
                best = best_of[node]
                if best == _NONE or (best >= 0 and count[best] == 1 and buf[best][start[best]] > token):
                    best_of[node] = leaf
                active[i] = leaf
            elif node != ROOT and count[node] == count[child] + 1:
                # This suffix is the only one ending at `node` and every other goes on to `child`: after the
                # step the two would carry equal counts, so they become one edge.
                if length[child] == 1:
                    parent = parent_of[node]
                    key = buf[node][start[node]]
                    buf[child], start[child], length[child] = toks, pos - length[node], length[node] + 1
                    count[child] += 1
                    parent_of[child] = parent
                    children_of[parent][key] = child
                    if best_of[parent] == node:
                        best_of[parent] = child
                    children_of[node] = None  # its only child moved up
                    self._release(node)
                    active[i] = child
                else:
                    buf[node], start[node] = toks, pos - length[node]
                    length[node] += 1
                    del children[token]
                    start[child] += 1
                    length[child] -= 1
                    children[buf[child][start[child]]] = child
                    best_of[node] = child
            elif length[child] == 1:
                n = count[child] = count[child] + 1
                buf[child], start[child] = toks, pos
                best = best_of[node]
                if best == _NONE or (best >= 0 and best != child and (
                        n > count[best] or (n == count[best] and token < buf[best][start[best]]))):
                    best_of[node] = child
                active[i] = child
            else:
                # Split `child` after its first token; the new node carries this suffix as well.
                n = count[child] + 1
                mid = self._new(node, toks, pos, 1, n)
                start[child] += 1
                length[child] -= 1
                parent_of[child] = mid
                children_of[mid] = {buf[child][start[child]]: child}
                best_of[mid] = child
                children[token] = mid
                best = best_of[node]
                if best == child or best == _NONE or (best >= 0 and (
                        n > count[best] or (n == count[best] and token < buf[best][start[best]]))):
                    best_of[node] = mid
                active[i] = mid

    def remove(self, seq_id: int) -> None:
        """Take a sequence's occurrences out of every count; O(depth) node operations per token."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        buf, start, length, count = self.buf, self.start, self.length, self.count
        children_of, best_of = self.children, self.best
        toks = seq.tokens
        n_tok = len(toks)
        for s in range(n_tok):
            count[ROOT] -= 1
            node = ROOT
            i, end = s, min(n_tok, s + self.depth)
            while i < end:
                child = children_of[node][toks[i]]
                self.ops += 1
                count[child] -= 1
                if best_of[node] == child:
                    best_of[node] = _STALE
                if count[child] == 0:
                    del children_of[node][toks[i]]
                    self._release(child)
                    break
                if buf[child] is toks:
                    # Keep the label, not the evicted token list.
                    buf[child], start[child] = tuple(toks[start[child] : start[child] + length[child]]), 0
                i += length[child]
                node = child
            kids = children_of[node]
            if node != ROOT and kids and len(kids) == 1:
                (only,) = kids.values()
                if count[only] == count[node]:
                    self._merge_into_child(node, only)

    def _merge_into_child(self, node: int, child: int) -> None:
        """`node` has one child of equal count: the child takes its place with the joined label."""
        buf, start, length = self.buf, self.start, self.length
        parent = self.parent[node]
        key = buf[node][start[node]]
        if buf[child] is buf[node] and start[child] == start[node] + length[node]:
            start[child] = start[node]
        else:
            buf[child] = tuple(buf[node][start[node] : start[node] + length[node]]) + tuple(
                buf[child][start[child] : start[child] + length[child]]
            )
            start[child] = 0
        length[child] += length[node]
        self.parent[child] = parent
        self.children[parent][key] = child
        if self.best[parent] == node:
            self.best[parent] = child
        self.children[node] = None
        self._release(node)

    # -- queries -----------------------------------------------------------------------------------------
    def match(self, pattern: list[int]) -> tuple[int, int] | None:
        """(node, tokens of its edge consumed) where `pattern` ends, or None when it does not occur."""
        buf, start, length, children_of = self.buf, self.start, self.length, self.children
        node, j, used, n = ROOT, 0, 0, len(pattern)
        while j < n:
            self.ops += 1
            children = children_of[node]
            child = children.get(pattern[j], _NONE) if children else _NONE
            if child == _NONE:
                return None
            take = min(length[child], n - j)
            label = buf[child]
            piece = pattern[j : j + take]
            if label[start[child] : start[child] + take] != (tuple(piece) if type(label) is tuple else piece):
                return None
            node, j, used = child, j + take, take
        return node, used

    def _best_child(self, node: int) -> int:
        best = self.best[node]
        if best == _STALE:
            count = self.count
            best, key = _NONE, None
            for token, child in (self.children[node] or {}).items():
                if best == _NONE or count[child] > count[best] or (count[child] == count[best] and token < key):
                    best, key = child, token
            self.best[node] = best
        return best

    def walk(self, node: int, used: int, max_tokens: int, min_prob: float) -> Draft:
        """Follow the most frequent continuation from inside `node`'s edge, as suffix decoding drafts."""
        buf, start, length, count = self.buf, self.start, self.length, self.count
        draft = Draft()
        tokens = draft.tokens
        prob = 1.0
        while len(tokens) < max_tokens:
            self.ops += 1
            if used < length[node]:
                take = min(length[node] - used, max_tokens - len(tokens))
                first = start[node] + used
                tokens.extend(buf[node][first : first + take])
                for _ in range(take):
                    draft.score += prob  # token by token, so scores compare exactly as a reference's
                used += take
                continue
            child = self._best_child(node)
            if child == _NONE:
                break
            prob *= count[child] / count[node]
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
        active, length = self.seqs[seq_id].active, self.length
        return self._speculate(((active[-m], length[active[-m]]) for m in range(1, len(active))), max_tokens,
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
