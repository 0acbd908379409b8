"""Build onecard/data/bench/coding_assistant.json, `onecard bench`'s default workload (run once; committed).

Six coding-assistant conversations of four turns each, all under one long system prompt (a prefix every
request shares); each conversation opens with a source file from CPython's standard library (PSF license,
taken from the Python that runs this script, at most MAX_LINES lines; `onecard bench` puts it in place of
{code} in the first turn, trimmed to fit the server's max_model_len) and asks for an explanation, a code
edit, a diff and tests, so later turns resend the whole history (a per-conversation shared prefix).
Usage: python scripts/build_bench_workload.py [OUT.json]
"""
from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
from pathlib import Path

MAX_LINES = 220
OUTPUTS = [128, 256, 192, 256]       # max_tokens per turn: explanation, edit, diff, tests

SYSTEM = """You are an expert software engineer working as a coding assistant inside the user's editor. You \
help with Python code: you read the files the user shares, explain how they work, propose focused edits and \
write tests. Follow these rules.

1. Be precise. Refer to functions, classes and variables by their exact names, and quote the lines you \
talk about. If the code does not show something, say that you cannot see it instead of guessing.
2. When you change code, change as little as possible, keep the existing style (naming, docstrings, \
comments, line length) and keep behaviour the same unless the user asked for a change in behaviour. Show \
complete functions, not fragments, so the user can paste them.
3. When the user asks for a diff, answer with a unified diff against the file as shared (---/+++ headers, \
@@ hunk headers with line numbers, three lines of context), and nothing after the diff but one sentence \
that says what it changes.
4. Tests use pytest. Each test checks one behaviour, has a name that says which, and uses plain asserts. \
Cover the normal case, the edges (empty input, one element, boundaries) and the errors the code raises.
5. Type hints follow PEP 484 and PEP 604 (`int | None`, `list[str]`); do not add imports that the file \
does not need.
6. Keep answers short: a few sentences of explanation, then code. Never repeat the whole file back.
7. If a request is ambiguous, pick the most likely reading, say which one you picked, and go on.
8. Security matters: never suggest eval or exec on user input, shell=True with untrusted strings, or \
disabling certificate checks; point out such code when you see it.
"""

CONVERSATIONS = {
    "fnmatch": [
        "Here is `{file}`:\n\n```python\n{code}\n```\n\nExplain how `translate` turns a shell pattern into a "
        "regular expression, step by step.",
        "Rewrite `filter` so it builds the result with a list comprehension. Show the complete function.",
        "Add type hints to `fnmatch`, `fnmatchcase` and `filter`. Reply with a unified diff.",
        "Write pytest tests for `fnmatchcase` covering `*`, `?`, `[seq]`, `[!seq]` and an empty pattern.",
    ],
    "bisect": [
        "Here is `{file}`:\n\n```python\n{code}\n```\n\nWhat is the difference between `bisect_left` and "
        "`bisect_right`, and when does `key` get called?",
        "Refactor `insort_left` and `insort_right` to share one private helper. Show both functions and the "
        "helper.",
        "Make `bisect_left` raise a ValueError with a clear message when `hi` is larger than `len(a)`. Reply "
        "with a unified diff.",
        "Write pytest tests for `bisect_left` and `insort_right`: duplicates, `lo`/`hi` bounds and `key`.",
    ],
    "textwrap": [
        "Here is `{file}`:\n\n```python\n{code}\n```\n\nExplain what `TextWrapper._wrap_chunks` does with "
        "`break_long_words` and `break_on_hyphens`.",
        "Add a `max_lines` check to `TextWrapper.__init__` that raises ValueError for values below 1. Show the "
        "complete method.",
        "Add type hints to `TextWrapper.__init__` and `_split`. Reply with a unified diff.",
        "Write pytest tests for `TextWrapper.wrap` with `width`, `initial_indent` and `break_long_words=False`.",
    ],
    "shlex": [
        "Here is `{file}`:\n\n```python\n{code}\n```\n\nWalk me through the states of `shlex.read_token` for "
        "the input `a \"b c\" d`.",
        "Add a `__repr__` to `shlex` that shows `infile`, `lineno` and `posix`. Show the method.",
        "Make `push_token` reject non-string tokens with a TypeError. Reply with a unified diff.",
        "Write pytest tests for `shlex.get_token` with quotes, escapes, comments and `whitespace_split=True`.",
    ],
    "heapq": [
        "Here is `{file}`:\n\n```python\n{code}\n```\n\nExplain the difference between `heappushpop` and "
        "`heapreplace`, and why `_siftup` moves the smaller child up.",
        "Write a `heapify_max`-style helper `nlargest_fast(n, iterable)` that uses `_heapify_max` and "
        "`_heapreplace_max`. Show the complete function.",
        "Add type hints to `heappush`, `heappop` and `heapify`. Reply with a unified diff.",
        "Write pytest tests for `heappushpop` and `heapreplace` on empty and one-element heaps.",
    ],
    "difflib": [
        "Here is `{file}`:\n\n```python\n{code}\n```\n\nExplain how `SequenceMatcher.__chain_b` builds `b2j` "
        "and what the autojunk heuristic does.",
        "Add a `__repr__` to `SequenceMatcher` that shows the lengths of `a` and `b`. Show the method.",
        "Make `set_seqs` accept only sequences and raise a TypeError otherwise. Reply with a unified diff.",
        "Write pytest tests for `SequenceMatcher.ratio` and `quick_ratio` on equal, disjoint and empty inputs.",
    ],
}


def main(out: str) -> None:
    convs = []
    for mod_name, turns in CONVERSATIONS.items():
        mod = importlib.import_module(mod_name)
        code = "\n".join(inspect.getsource(mod).splitlines()[:MAX_LINES])
        file = Path(inspect.getsourcefile(mod)).name
        first = turns[0].replace("{file}", file)          # {code} is filled in (and trimmed to fit) at run time
        convs.append({"name": mod_name, "code": code,
                      "turns": [{"user": u, "max_tokens": m} for u, m in zip([first, *turns[1:]], OUTPUTS)]})
    data = {"name": "coding-assistant", "source": f"CPython {platform.python_version()} standard library "
            "(PSF license), first lines of each module", "system": SYSTEM, "conversations": convs}
    Path(out).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         str(Path(__file__).resolve().parents[1] / "onecard" / "data" / "bench" / "coding_assistant.json"))
