"""SiLU-gated activation ``silu(x[:, :I]) * x[:, I:]``: ``ref.py`` and ``triton.py``."""
