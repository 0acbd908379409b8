"""Registers and stack (spills) per thread of every fp16 Triton kernel config, compiled as the JIT specializes
them at serving time (16-byte-aligned pointers, 16-divisible ints), for sm70 and sm90, and the instructions of
its longest loop (the body of its longest backward branch: the K loop of the GEMMs, where a thread's share of
one weight tile is dequantized and multiplied). No GPU needed: Triton's bundled ptxas and cuobjdump. The
configs are the AOT list (tests/kernels/test_aot.py), which holds every variant the dispatchers choose at the
served shape.

Usage: python bench/sass_report.py [OUT.json] [--only SUB1,SUB2]   (--only: configs whose name contains one)
"""
from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

TARGETS = (70, 90)


def _resources(job: tuple[str, int, int]) -> tuple[str, int, int | None, int | None]:
    import triton
    from test_aot import jit_aligned_attrs, resource_usage  # tests/kernels is on sys.path
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, i, cc = job
    c = importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()[i]
    cx = dict(c.constexprs)
    if "PDL" in cx:
        cx["PDL"] = cc >= 90
    src = ASTSource(fn=c.kernel, signature=c.signature, constexprs=cx, attrs=jit_aligned_attrs(c))
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    reg, stack = resource_usage(k.asm["cubin"]) or (None, None)
    return c.name, cc, reg, stack, loop_instructions(k.asm["cubin"])


def loop_instructions(cubin: bytes) -> int | None:
    """Instructions in the body of the kernel's longest backward branch (None: no loop)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    best = None
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/[^\n]*?\bBRA\b[^\n]*?(0x[0-9a-f]+)", sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < at:
            n = (at - target) // 16 + 1                                  # 16-byte instructions (sm70+)
            best = n if best is None else max(best, n)
    return best


def main(out: str | None = None, only: list[str] | None = None) -> dict:
    from test_aot import MODULES

    jobs = []
    for mod in MODULES:
        for i, c in enumerate(importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()):
            if "bf16" not in c.name and (only is None or any(sub in c.name for sub in only)):
                jobs += [(mod, i, cc) for cc in TARGETS if cc >= c.min_cc]
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        rows = list(pool.map(_resources, jobs))
    res: dict = {}
    for name, cc, reg, stack, loop in rows:
        res.setdefault(name, {})[f"sm{cc}"] = {"registers": reg, "stack_bytes": stack, "loop_instructions": loop}
    print(f"{'config':62s} " + "  ".join(f"sm{cc} reg/stack/loop" for cc in TARGETS))
    for name, d in res.items():
        cells = [f"{d[f'sm{cc}']['registers']:>3}/{d[f'sm{cc}']['stack_bytes']:<4}/{d[f'sm{cc}']['loop_instructions']}"
                 if f"sm{cc}" in d else "-" for cc in TARGETS]
        print(f"{name:62s} " + "      ".join(f"{c:18s}" for c in cells))
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = args[i + 1].split(",")
        args = args[:i] + args[i + 2:]
    main(args[0] if args else None, only)
