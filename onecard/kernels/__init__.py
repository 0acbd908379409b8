"""Kernels: one folder per op, each with ``ref.py`` (plain PyTorch, float32-accurate: the spec) and
``triton.py`` (fast, same signature). Callers use ``onecard.kernels.dispatch`` (re-exported as ``ops``)."""
