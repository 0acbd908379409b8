"""Paged KV-cache store and varlen paged attention (prefill chunks + decode): ``ref.py`` and ``triton.py``."""
