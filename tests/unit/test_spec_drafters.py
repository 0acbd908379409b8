"""Drafters (onecard/core/spec) against brute-force references that rescan everything on every call.

- ngram: the reference scans the whole token list (largest n first, earliest occurrence); a second reference
  runs vLLM's algorithm as published (KMP over the reversed tokens) to pin the semantics to vLLM's.
- suffix: the reference recounts every substring occurrence from scratch (prompt + output of the request,
  outputs of the cached requests) and follows Arctic Inference's path speculation.
Also: incremental calls (one token at a time, chunks, observe()) equal one-shot calls; finish/abort forget;
the global cache keeps the newest `max_cached_requests` outputs; work per call is bounded (node/dict
operation counters, not wall time); make_drafter maps vLLM's keys and defaults.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from onecard.core.spec.drafter import Drafter, make_drafter
from onecard.core.spec.ngram import NgramDrafter
from onecard.core.spec.suffix import SuffixDrafter
from onecard.core.spec.suffix_tree import ROOT, SuffixTree

# -- references ----------------------------------------------------------------------------------------


def ngram_ref(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    n_tok = len(tokens)
    for n in range(hi, lo - 1, -1):
        suffix = tokens[n_tok - n :] if n <= n_tok else None
        if suffix is None:
            continue
        for end in range(n - 1, n_tok - 1):  # occurrences ending at <= n_tok - 2, earliest first
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def ngram_vllm_kmp(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """vLLM's published algorithm (reverse the tokens, KMP prefix function capped at hi)."""
    total = len(tokens)
    if total < lo:
        return []
    rev = tokens[::-1]
    lps = [0] * hi
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < hi:
                lps[i] = prev
            if prev == hi:
                prev = lps[hi - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < lo:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + min(k, total - start)]


def _count(seqs: list[list[int]], pat: list[int], depth: int) -> int:
    if len(pat) > depth:
        return 0
    m = len(pat)
    return sum(1 for s in seqs for i in range(len(s) - m + 1) if s[i : i + m] == pat)


def _next_counts(seqs: list[list[int]], pat: list[int], depth: int) -> dict[int, int]:
    """count(pat + [t]) for every t that follows an occurrence of pat (strings longer than depth: none)."""
    out: dict[int, int] = {}
    m = len(pat)
    if m + 1 > depth:
        return out
    for s in seqs:
        for i in range(len(s) - m):
            if s[i : i + m] == pat:
                out[s[i + m]] = out.get(s[i + m], 0) + 1
    return out


def _speculate_ref(seqs, depth, pattern, k, factor, min_prob) -> tuple[list[int], float]:
    best: tuple[list[int], float] = ([], 0.0)
    n = len(pattern)
    for m in range(1, n):
        cur = pattern[n - m :]
        here = _count(seqs, cur, depth)
        if here == 0:
            break
        cap = min(k, int(m * factor + 1e-6))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < cap:
            nexts = _next_counts(seqs, cur, depth)
            if not nexts:
                break
            cnt, neg_t = max((c, -t) for t, c in nexts.items())  # most frequent, then smallest id
            p = prob * cnt / here
            if p < min_prob:
                break
            prob, here = p, cnt
            draft.append(-neg_t)
            cur = cur + [-neg_t]
            score += prob
        if score >= best[1]:
            best = (draft, score)
    return best


def suffix_ref(local: list[int], outputs: list[list[int]], depth, k, factor, min_prob) -> list[int]:
    pattern = local[-depth:]
    draft, score = _speculate_ref([local], depth, pattern, k, factor, min_prob)
    if outputs:
        other, other_score = _speculate_ref(outputs, depth, pattern, k, factor, min_prob)
        if other_score > score:
            draft = other
    return draft


def _sequences(rng: random.Random, count: int, length: int) -> list[list[int]]:
    """Random, repetitive (copied spans, small alphabets) and periodic token lists."""
    out = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            out.append([rng.randrange(50) for _ in range(length)])
        elif kind == 1:
            out.append([rng.randrange(4) for _ in range(length)])
        elif kind == 2:
            base = [rng.randrange(30) for _ in range(length // 2)]
            seq = list(base)
            while len(seq) < length:  # re-quote pieces of the text, as edits do
                a = rng.randrange(len(base))
                seq += base[a : a + rng.randrange(1, 12)] + [rng.randrange(30)]
            out.append(seq[:length])
        else:
            period = [rng.randrange(10) for _ in range(rng.randrange(1, 6))]
            out.append((period * length)[:length])
    return out


# -- ngram -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lo,hi,k", [(5, 5, 5), (1, 3, 4), (2, 4, 8), (1, 1, 2), (3, 6, 1)])
def test_ngram_equals_scan_and_vllm_algorithm(lo, hi, k):
    rng = random.Random(lo * 100 + hi * 10 + k)
    for seq in _sequences(rng, 12, 160):
        drafter = NgramDrafter(k, prompt_lookup_min=lo, prompt_lookup_max=hi)
        for n_tok in range(1, len(seq) + 1):
            got = drafter.propose("r", seq[:n_tok], k)
            want = ngram_ref(seq[:n_tok], lo, hi, k)
            assert got == want, (n_tok, seq[:n_tok])
            assert want == ngram_vllm_kmp(seq[:n_tok], lo, hi, k)


def test_ngram_chunks_observe_numpy_and_max_k_match_one_shot():
    rng = random.Random(7)
    for seq in _sequences(rng, 8, 300):
        steps = NgramDrafter(6, prompt_lookup_min=2, prompt_lookup_max=4)
        n_tok = 0
        while n_tok < len(seq):
            n_tok = min(len(seq), n_tok + rng.randrange(1, 40))
            if rng.random() < 0.5:
                steps.observe("a", np.asarray(seq[:n_tok], dtype=np.int32))
            else:
                max_k = rng.randrange(0, 8)
                got = steps.propose("a", np.asarray(seq[:n_tok], dtype=np.int64), max_k)
                one_shot = NgramDrafter(6, prompt_lookup_min=2, prompt_lookup_max=4)
                assert got == one_shot.propose("b", seq[:n_tok], max_k)
                assert all(type(t) is int for t in got)
                assert len(got) <= min(max_k, 6)


def test_ngram_finish_forgets_and_broken_history_restarts():
    d = NgramDrafter(3, prompt_lookup_min=1, prompt_lookup_max=2)
    assert d.propose("r", [1, 2, 3, 1], 3) == [2, 3, 1]
    d.finish("r", [1, 2, 3, 1])
    assert "r" not in d._reqs
    # A caller that rewrites history gets drafts for the new tokens, not stale index entries.
    d.propose("s", [1, 2, 3, 1, 2], 3)
    assert d.propose("s", [9, 8, 7, 9], 3) == ngram_ref([9, 8, 7, 9], 1, 2, 3)


def test_ngram_work_per_call_is_bounded():
    rng = random.Random(3)
    long = [rng.randrange(100) for _ in range(20000)]
    d = NgramDrafter(5, prompt_lookup_min=1, prompt_lookup_max=4)
    d.observe("r", long)
    index_before = d.index_ops
    assert index_before <= 4 * len(long)
    for step in range(1, 50):
        q0, i0 = d.query_ops, d.index_ops
        d.propose("r", long + list(range(step)), 5)
        assert d.query_ops - q0 <= 4  # one lookup per n, whatever the length
        assert d.index_ops - i0 <= 4 * (step + 1)  # only the newly eligible positions


# -- suffix tree and suffix drafter ----------------------------------------------------------------------


@pytest.mark.parametrize("depth,k,factor,min_prob", [(24, 8, 1.0, 0.1), (6, 4, 1.0, 0.1), (5, 6, 2.0, 0.0),
                                                     (8, 3, 0.5, 0.3), (3, 5, 1.0, 1.0)])
def test_suffix_equals_recount_reference(depth, k, factor, min_prob):
    rng = random.Random(depth * 1000 + k)
    seqs = _sequences(rng, 8, 70)
    drafter = SuffixDrafter(k, max_tree_depth=depth, max_cached_requests=3, max_spec_factor=factor,
                            min_token_prob=min_prob)
    finished: list[list[int]] = []  # outputs in the global tree, oldest first
    for r, seq in enumerate(seqs):
        prompt_len = len(seq) // 3
        drafter.observe(f"r{r}", seq[:prompt_len])
        for n_tok in range(prompt_len + 1, len(seq) + 1):
            got = drafter.propose(f"r{r}", seq[:n_tok], k)
            outputs = finished[-2:] + [seq[prompt_len:n_tok]]  # 3 slots: two earlier and this one
            want = suffix_ref(seq[:n_tok], outputs, depth, k, factor, min_prob)
            assert got == want, (r, n_tok)
        drafter.finish(f"r{r}", seq)
        finished.append(seq[prompt_len:])
    assert drafter.cached_requests == [f"r{r}" for r in range(len(seqs) - 3, len(seqs))]


def test_suffix_ties_go_to_the_smaller_token():
    """Tiny alphabets make equal counts common: the draft follows the smaller token id, as the reference."""
    d = SuffixDrafter(4, max_tree_depth=4, max_cached_requests=0, min_token_prob=0.0)
    assert d.propose("t", [1, 5, 1, 3, 1], 1) == [3]  # after 1: 5 once, 3 once
    assert d.propose("u", [1, 3, 1, 5, 1], 1) == [3]  # the order of appearance does not matter
    rng = random.Random(21)
    for r in range(30):
        seq = [rng.randrange(3) for _ in range(40)]
        d = SuffixDrafter(3, max_tree_depth=4, max_cached_requests=0, min_token_prob=0.0)
        for n_tok in range(1, len(seq) + 1):
            assert d.propose(f"t{r}", seq[:n_tok], 3) == suffix_ref(seq[:n_tok], [], 4, 3, 1.0, 0.0)


def test_suffix_tree_counts_survive_removals():
    """Counts after interleaved appends and removals equal a recount, for every substring <= depth."""
    rng = random.Random(11)
    depth = 5
    tree = SuffixTree(depth)
    live: dict[int, list[int]] = {}
    removed: list[list[int]] = []
    for step in range(60):
        sid = rng.randrange(6)
        if sid in live and rng.random() < 0.3:
            removed.append(tree.seqs[sid].tokens)
            tree.remove(sid)
            del live[sid]
        else:
            new = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
            tree.extend(sid, new)
            live.setdefault(sid, []).extend(new)
        seqs = list(live.values())
        for _ in range(20):
            src = seqs[rng.randrange(len(seqs))] if seqs else [0]
            a = rng.randrange(len(src))
            pat = src[a : a + rng.randrange(1, depth + 2)]
            found = tree.match(pat)
            want = _count(seqs, pat, depth)
            got = 0 if found is None else tree.count[found[0]]
            assert got == want, (step, pat)
        assert tree.count[ROOT] == sum(len(s) for s in seqs)
        _check_compressed(tree, removed)


def _check_compressed(tree: SuffixTree, removed: list[list[int]]) -> None:
    """Structure: labels keyed by their first token, counts >= the children's sum, no chain of equal
    counts left unmerged (the tree stays O(tokens) nodes), no label pointing into a removed token list,
    every freed id unreachable and every reachable id live."""
    stack, seen = [ROOT], set()
    while stack:
        node = stack.pop()
        seen.add(node)
        kids = tree.children[node] or {}
        assert tree.count[node] >= sum(tree.count[c] for c in kids.values())
        if node != ROOT:
            assert tree.count[node] >= 1 and tree.length[node] >= 1
            assert not (len(kids) == 1 and tree.count[next(iter(kids.values()))] == tree.count[node])
            assert all(tree.buf[node] is not r for r in removed)
        for key, child in kids.items():
            assert tree.parent[child] == node and tree.buf[child][tree.start[child]] == key
            stack.append(child)
    assert not seen & set(tree._free) and len(seen) == tree.num_nodes


def test_suffix_incremental_equals_one_shot_and_chunked():
    rng = random.Random(5)
    for seq in _sequences(rng, 6, 200):
        a = SuffixDrafter(5, max_tree_depth=10, max_cached_requests=0)
        n_tok = 1
        a.observe("x", seq[:1])
        while n_tok < len(seq):
            n_tok = min(len(seq), n_tok + rng.randrange(1, 30))
            got = a.propose("x", np.asarray(seq[:n_tok]), 5)
            b = SuffixDrafter(5, max_tree_depth=10, max_cached_requests=0)
            assert got == b.propose("y", seq[:n_tok], 5)
            assert all(type(t) is int for t in got)


def test_suffix_global_cache_reuse_abort_and_fifo_bound():
    d = SuffixDrafter(4, max_tree_depth=8, max_cached_requests=2)
    out = [7, 8, 9, 10, 11, 12]
    # Request a: prompt [1, 2], output `out`; finished, so its output is reusable by other requests.
    d.observe("a", [1, 2])
    d.propose("a", [1, 2, 7], 4)
    d.finish("a", [1, 2] + out)
    assert d.cached_requests == ["a"]
    a_tokens = d.global_tree.seqs[d._cached["a"]].tokens
    assert a_tokens == out
    # Request b never produced 11, 12 itself: the global tree drafts them (match [7, 8, 9, 10]).
    d.observe("b", [5, 5, 5, 7, 8, 9])
    assert d.propose("b", [5, 5, 5, 7, 8, 9, 10], 4) == [11, 12]
    assert d.propose("b", [5, 5, 5, 7, 8, 9, 10], 4) == suffix_ref(
        [5, 5, 5, 7, 8, 9, 10], [out, [10]], 8, 4, 1.0, 0.1)
    # Aborting b forgets its partial output; a stays.
    d.finish("b", None)
    assert d.cached_requests == ["a"] and "b" not in d._reqs
    assert d.global_tree.count[ROOT] == len(out)
    # Two more requests: the oldest-started (a) is evicted, and its output no longer drafts.
    for rid, toks in (("c", [3, 40, 41, 42]), ("e", [3, 7, 8, 9, 10, 50])):
        d.observe(rid, toks[:1])
        d.propose(rid, toks[:2], 4)
        d.finish(rid, toks)
    assert d.cached_requests == ["c", "e"]
    assert d.propose("f", [6, 6, 7, 8, 9, 10], 4) == [50]
    assert d.propose("f", [6, 6, 7, 8, 9, 10], 4) == suffix_ref(
        [6, 6, 7, 8, 9, 10], [[40, 41, 42], [7, 8, 9, 10, 50], [10]], 8, 4, 1.0, 0.1)
    assert d.cached_requests == ["e", "f"]  # f's start evicted c
    # The evicted token lists are not kept alive by edge labels that pointed into them.

    tree = d.global_tree
    assert all(tree.buf[n] is not a_tokens for n in range(len(tree.buf)) if n not in tree._free)


def test_suffix_work_per_call_is_bounded():
    rng = random.Random(9)
    depth, k = 24, 8
    d = SuffixDrafter(k, max_tree_depth=depth, max_cached_requests=4)
    prompt = _sequences(rng, 3, 6000)[2]  # repetitive: long matches everywhere
    d.observe("r", prompt)
    assert d.ops <= depth * len(prompt)
    toks = list(prompt)
    for step in range(40):
        toks.append(toks[len(toks) - 3000])  # keep copying: the worst case for matching
        before = d.ops
        d.propose("r", toks, k)
        # local + global: appending 1 token (<= depth each) and speculating (depth match lengths, each a
        # match of <= depth edges and a walk of <= k + 1 steps), whatever the prompt's length
        assert d.ops - before <= 2 * (depth + depth * (depth + k + 1))


def test_make_drafter_maps_vllm_keys_and_defaults():
    d = make_drafter("ngram", 4)
    assert isinstance(d, Drafter) and (d.min_n, d.max_n, d.k) == (5, 5, 4)
    assert (make_drafter("ngram", 3, prompt_lookup_max=7).min_n) == 7
    assert (make_drafter("ngram", 3, prompt_lookup_min=2).max_n) == 2
    s = make_drafter("suffix", None)
    assert isinstance(s, Drafter)
    assert (s.k, s.depth, s.max_cached, s.spec_factor, s.min_prob) == (24, 24, 10000, 1.0, 0.1)
    s = make_drafter("suffix", 6, suffix_decoding_max_tree_depth=12, suffix_decoding_min_token_prob=0.5)
    assert (s.k, s.depth, s.min_prob) == (6, 12, 0.5)
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        make_drafter("ngram", 2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="do not apply to method 'suffix'"):
        make_drafter("suffix", 2, prompt_lookup_min=4)
    with pytest.raises(ValueError, match="eagle"):
        make_drafter("eagle", 2)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        make_drafter("ngram", 0)
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        make_drafter("suffix", 2, suffix_decoding_min_token_prob=1.5)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_stale_then_fresh_proposals_equal_fresh_only(method):
    """The async engine loop proposes from the tokens known while a step is in flight (stale by one token), then,
    when it drains that step, from the fresh tokens: the fresh draft must be the one a drafter asked only the fresh
    tokens gives (the calls stay append-only; nothing is indexed twice or out of order), for every request and,
    for suffix, with the global tree of earlier outputs shared."""
    def make():
        if method == "ngram":
            return NgramDrafter(5, prompt_lookup_min=1, prompt_lookup_max=3)
        return SuffixDrafter(5, max_tree_depth=8, max_cached_requests=2)

    rng = random.Random(11)
    both, fresh_only = make(), make()
    stale_hits = 0
    for r, seq in enumerate(_sequences(rng, 8, 90)):
        rid, prompt_len = f"r{r}", len(seq) // 3
        for d in (both, fresh_only):
            d.observe(rid, seq[:prompt_len])
        for n_tok in range(prompt_len + 1, len(seq) + 1):
            if rng.random() < 0.7:                 # a step was in flight: its token is not known yet
                stale = both.propose(rid, seq[:n_tok - 1], 6)
                stale_hits += bool(stale)
            assert both.propose(rid, seq[:n_tok], 5) == fresh_only.propose(rid, seq[:n_tok], 5), (r, n_tok)
        for d in (both, fresh_only):
            d.finish(rid, seq)
    assert stale_hits > 20
