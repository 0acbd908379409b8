"""A small inventory of helpers, written for onecard's tests (never part of any training set).

The bundled tiny coder's perplexity on this file is measured at release and checked in CI.
"""

import os
import re
from collections import defaultdict


def parse_key_value_lines(text, sep="="):
    """Return a dict from lines of the form ``key = value``, ignoring blanks and comments."""
    result = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if sep not in line:
            raise ValueError("missing %r in line: %r" % (sep, line))
        key, value = line.split(sep, 1)
        result[key.strip()] = value.strip()
    return result


def chunked(iterable, size):
    """Yield lists of at most *size* items from *iterable*."""
    if size <= 0:
        raise ValueError("size must be positive")
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def find_files(root, pattern=r".*\.py$"):
    """Return the sorted paths below *root* whose file name matches *pattern*."""
    regex = re.compile(pattern)
    matches = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if regex.match(name):
                matches.append(os.path.join(dirpath, name))
    return sorted(matches)


class Counter:
    """Count occurrences of hashable items."""

    def __init__(self, items=None):
        self._counts = defaultdict(int)
        if items is not None:
            self.update(items)

    def update(self, items):
        for item in items:
            self._counts[item] += 1

    def most_common(self, n=None):
        """Return a list of the *n* most common items and their counts."""
        pairs = sorted(self._counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
        return pairs if n is None else pairs[:n]

    def __getitem__(self, item):
        return self._counts.get(item, 0)

    def __len__(self):
        return len(self._counts)

    def __repr__(self):
        return "%s(%r)" % (self.__class__.__name__, dict(self._counts))


def flatten(nested):
    """Flatten a list of lists (one level) into a single list."""
    out = []
    for sub in nested:
        if isinstance(sub, (list, tuple)):
            out.extend(sub)
        else:
            out.append(sub)
    return out


def is_prime(n):
    """Return True if *n* is a prime number."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


if __name__ == "__main__":
    print(parse_key_value_lines("a = 1\n# comment\nb = two"))
    print(list(chunked(range(7), 3)))
    print(Counter("abracadabra").most_common(2))
