"""A refactor's check that kernels did not change: the PTX of every AOT kernel config (tests/kernels/test_aot.py's
list, constexprs and compile options) for sm70 and sm90, plain and JIT-aligned, with .file/.loc lines and DWARF
sections stripped, hashed per config (OUT.json) and in full (OUT.json.ptx.json). Run it on a copy of the tree
before and after and compare the JSON (CPU only; Triton's bundled ptxas; ~30 min on a busy 2-core machine).
Usage: PYTHONPATH=TREE python bench/ptx_snapshot.py TREE OUT.json [MODULE ...]  (MODULEs: a subset of
test_aot.MODULES, e.g. ``attention`` when only that package was touched; default all)"""
import hashlib
import importlib
import importlib.util
import json
import multiprocessing as mp
import re
import sys
from concurrent.futures import ProcessPoolExecutor

TREE = sys.argv[1]


def _aot():
    spec = importlib.util.spec_from_file_location("test_aot", f"{TREE}/tests/kernels/test_aot.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def strip(ptx: str) -> str:
    ptx = re.sub(r"^\s*\.section\s+\.debug\w*\s*\{.*?^\s*\}", "", ptx, flags=re.DOTALL | re.MULTILINE)
    return "\n".join(l for l in ptx.splitlines() if not re.match(r"\s*\.(file|loc)\b", l))


def job(j):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    aot = _aot()
    mod, i, cc, aligned = j
    c = importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()[i]
    cx = dict(c.constexprs)
    if "PDL" in cx:
        cx["PDL"] = cc >= 90
    attrs = aot.jit_aligned_attrs(c) if aligned else None
    k = triton.compile(ASTSource(fn=c.kernel, signature=c.signature, constexprs=cx, attrs=attrs),
                       target=GPUTarget("cuda", cc, 32), options={"num_warps": c.num_warps,
                                                                  "num_stages": c.num_stages})
    s = strip(k.asm["ptx"])
    return f"{mod}:{c.name}:sm{cc}:{'aligned' if aligned else 'plain'}", hashlib.sha256(s.encode()).hexdigest(), s


if __name__ == "__main__":
    aot = _aot()
    jobs = []
    for mod in sys.argv[3:] or aot.MODULES:
        for i, c in enumerate(importlib.import_module(f"onecard.kernels.{mod}.triton").aot_configs()):
            is_bf16 = any(v == "*bf16" for v in c.signature.values())
            for cc in (70, 90):
                if cc >= c.min_cc and (not is_bf16 or cc == 90):
                    for al in (False, True):
                        jobs.append((mod, i, cc, al))
    out, texts = {}, {}
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        for key, h, s in pool.map(job, jobs):
            assert key not in out, key
            out[key] = h
            texts[key] = s
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    with open(sys.argv[2] + ".ptx.json", "w") as f:
        json.dump(texts, f)
    print(len(out), "configs")
