"""W4A16 GPTQ GEMM: ``ref.py`` (the spec, with ``dequantize_gptq``) and ``triton.py`` (fast paths)."""
