"""The vocabulary both processes read: the checkpoint's Hugging Face tokenizer, and xgrammar's view of it.

Contract: ``load_tokenizer(path)`` returns a Hugging Face tokenizer (fast when available; never the network),
raising ``ConfigError`` that names the path. ``tokenizer_info(tokenizer, vocab_size, stop_token_ids)`` is the
xgrammar ``TokenizerInfo`` of that vocabulary: process A compiles grammars against it (frontend/grammar.py) and
process B matches tokens against it (runner/structured.py), so both must build it from the same arguments, and
both build it here. Below every layer that uses it (no onecard import but env).
"""
from __future__ import annotations

from pathlib import Path

from onecard.env import ConfigError


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - reported with the path, at start-up
        raise ConfigError(f"cannot load the tokenizer from {path}: {type(e).__name__}: {e}") from None


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """The xgrammar view of the vocabulary (``vocab_size``: the model's logits width, padding included)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids) or None)
