"""L2 prefetch of static weights: ``table.py`` (the byte ranges, as a device table), ``ref.py`` (a no-op: a
prefetch changes no value) and ``triton.py`` (the kernel that brings the ranges into the GPU's L2)."""
