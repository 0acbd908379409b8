"""Incremental detokenization with stop strings (vLLM semantics), for process A.

Contract: one ``IncrementalDetokenizer`` per request. ``update(new_token_ids)`` returns
``DetokUpdate(text_delta, stop_string)``; ``flush()`` returns the text still held back when the request ends
for another reason (EOS, length, abort). ``.text`` is the output text so far, ``.token_ids`` the output ids.

- A character whose UTF-8 bytes span several tokens is held back until complete, so no delta ever ends in a
  replacement character mid-stream (vLLM's prefix/read-offset window: decode ``ids[prefix:]`` and
  ``ids[prefix:read]``, emit the difference once it does not end in U+FFFD). Each step decodes only a small
  window, so an update costs O(new tokens), not O(output length).
- Stop strings may span tokens. On a match the text is cut at the match (the stop string is kept only with
  ``include_stop_str_in_output``), ``stop_string`` names it, and every later ``update`` returns nothing: the
  caller aborts the request. Among several stops the match that *ends* first wins (ties: the longer one), so
  the result does not depend on how the tokens were batched into updates. An update of several tokens is
  checked after each token, and the tokens after the one that completed the match are dropped (not in
  ``token_ids``): the same outputs as one token per update.
- While stop strings are set, the last ``len(longest stop) - 1`` characters are held back so a partial stop
  is never streamed; ``flush()`` releases them.
- ``spaces_between_special_tokens`` only matters for slow (Python) tokenizers; fast byte-level BPE
  tokenizers join added tokens without spaces (as vLLM's fast detokenizer does).
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

# Prompt tokens kept as left context so the first output tokens decode as they would inside the sequence
# (leading-space handling of SentencePiece-style decoders). vLLM uses 5 as well.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class DetokUpdate(NamedTuple):
    """A NamedTuple so callers may unpack ``text, stop = detok.update(ids)``."""

    text_delta: str
    stop_string: str | None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, *, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.stop_string: str | None = None
        self.finished = False
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # Hold back a possible partial stop; with include_stop_str_in_output vLLM holds the same amount.
        self._hold = self._max_stop - 1 if self._max_stop else 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode_ids = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:  # slow tokenizer: the transformers path honours spaces_between_special_tokens
            self._decode_ids = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
                clean_up_tokenization_spaces=False)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context          # prompt context + output ids; only the window is decoded
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""                         # output text (cut at a stop match)
        self._emitted = 0                       # characters of _text already returned

    @property
    def text(self) -> str:
        return self._text

    # ------------------------------------------------------------------ decoding
    def _decode_next(self) -> str:
        """Text newly completed by the last id appended to ``_ids`` ("" while a character is incomplete)."""
        prefix_text = self._decode_ids(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode_ids(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def _pending_tail(self) -> str:
        """Text of ids not yet released (an incomplete character, or a genuine U+FFFD at the end)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode_ids(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode_ids(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    # ------------------------------------------------------------------ stop strings
    def _find_stop(self, search_from: int) -> tuple[str, int] | None:
        """The stop match ending first in ``_text`` at or after ``search_from``: (stop, cut position)."""
        best: tuple[int, int, str] | None = None     # (end, start, stop)
        for s in self.stop:
            start = self._text.find(s, max(0, search_from - len(s) + 1))
            if start < 0:
                continue
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, start, s = best
        return s, (end if self.include_stop_str_in_output else start)

    def _apply_stop(self, search_from: int) -> bool:
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return False
        hit = self._find_stop(search_from)
        if hit is None:
            return False
        self.stop_string, cut = hit
        self._text = self._text[:cut]
        self.finished = True
        return True

    # ------------------------------------------------------------------ public
    def update(self, new_token_ids: list[int]) -> DetokUpdate:
        if self.finished:
            return DetokUpdate("", None)
        search_from = len(self._text)
        each = bool(self.stop) and len(new_token_ids) > 1     # several tokens at once (speculative decoding)
        stopped = False
        for tid in new_token_ids:
            self.token_ids.append(tid)
            self._ids.append(tid)
            self._text += self._decode_next()
            if len(self.token_ids) <= self.min_tokens:
                search_from = len(self._text)   # stop strings count only after min_tokens (vLLM)
            elif each and self._apply_stop(search_from):
                stopped = True                  # the tokens after the one that completed the stop are dropped
                break
        if stopped or self._apply_stop(search_from):
            delta = self._text[self._emitted:]
            self._emitted = len(self._text)
            return DetokUpdate(delta, self.stop_string)
        limit = len(self._text) - self._hold
        if limit <= self._emitted:
            return DetokUpdate("", None)
        delta = self._text[self._emitted:limit]
        self._emitted = limit
        return DetokUpdate(delta, None)

    def flush(self) -> str:
        """Release everything held back; call once when the request finishes without a stop string."""
        if self.finished:
            delta = self._text[self._emitted:]
            self._emitted = len(self._text)
            return delta
        search_from = len(self._text)
        self._text += self._pending_tail()
        self._apply_stop(search_from)
        self.finished = True
        delta = self._text[self._emitted:]
        self._emitted = len(self._text)
        return delta
