"""RMSNorm with optional fused residual add: ``ref.py`` and ``triton.py``."""
