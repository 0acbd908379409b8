"""Per-head q/k RMSNorm followed by neox RoPE: ``ref.py`` and ``triton.py``."""
