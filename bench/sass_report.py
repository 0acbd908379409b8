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


def _resources(job: tuple[str, str, int]) -> tuple[str, int, int | None, int | None]:
    from test_aot import resource_usage  # tests/kernels is on sys.path

    mod, name, cc = job
    k = compile_config(mod, name, cc)
    reg, stack = resource_usage(k.asm["cubin"]) or (None, None)
    return name, cc, reg, stack, loop_instructions(k.asm["cubin"])


def _sass(cubin: bytes) -> str:
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def _loops(sass: str) -> list[tuple[int, int]]:
    """(first, last) address of each backward branch's body."""
    import re

    out = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/[^\n]*?\bBRA\b[^\n]*?(0x[0-9a-f]+)", sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < at:
            out.append((target, at))
    return out


def loop_instructions(cubin: bytes) -> int | None:
    """Instructions in the body of the kernel's longest backward branch (None: no loop)."""
    loops = _loops(_sass(cubin))
    return max(((b - a) // 16 + 1 for a, b in loops), default=None)   # 16-byte instructions (sm70+)


def inner_loop_mix(cubin: bytes) -> dict[str, int]:
    """Opcodes (without modifiers) of the innermost loop doing the kernel's most FFMAs: a GEMM's K loop, inside
    any loop around it (bench/v100_estimate.py turns the mix into cycles)."""
    import collections
    import re

    sass = _sass(cubin)
    ops = [(int(m.group(1), 16), m.group(3).split(".")[0]) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    mixes = [collections.Counter(op for at, op in ops if a <= at <= b) for a, b in _loops(sass)]
    if not mixes:
        return {}
    most = max(m["FFMA"] for m in mixes)
    return dict(min((m for m in mixes if m["FFMA"] == most), key=lambda m: sum(m.values())))


def compile_config(mod: str, name: str, cc: int):
    """One AOT config (kernels/<mod>/triton.aot_configs, by name) compiled for sm``cc`` as the JIT specializes it."""
    import triton
    from test_aot import jit_aligned_attrs  # tests/kernels is on sys.path
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    c = next(c for c in importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs() if c.name == name)
    cx = dict(c.constexprs)
    if "PDL" in cx:
        cx["PDL"] = cc >= 90
    src = ASTSource(fn=c.kernel, signature=c.signature, constexprs=cx, attrs=jit_aligned_attrs(c))
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options={"num_warps": c.num_warps, "num_stages": c.num_stages})


def main(out: str | None = None, only: list[str] | None = None) -> dict:
    from test_aot import MODULES

    jobs = []
    for mod in MODULES:
        for c in importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs():
            if "bf16" not in c.name and (only is None or any(sub in c.name for sub in only)):
                jobs += [(mod, c.name, cc) for cc in TARGETS if cc >= c.min_cc]
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
