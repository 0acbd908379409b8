"""Fused MoE (router softmax/top-k, expert GEMMs with SiLU·mul, top-k sum): ``ref.py`` and ``triton.py``."""
