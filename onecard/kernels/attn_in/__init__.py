"""A decoder layer's attention input (RMSNorm + qkv + q/k norm + RoPE + KV store): ``ref.py`` and ``triton.py``."""
