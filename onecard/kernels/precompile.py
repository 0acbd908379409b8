"""Compile, in parallel and before they are needed, the Triton kernel variants a start-up will launch.

Why: with a cold Triton cache (every fresh container) the engine JIT-compiles each kernel variant the first
time it is launched, one after another in the engine process: time to ready on the H200 was 42.6 s cold
against 17.7 s warm for the full-size model. The JIT can only compile what it is launching; this module
learns the whole list first and compiles it on every CPU at once.

How:
  * ``record()`` is a context manager during which no Triton kernel runs: Triton's ``jit_cache_hook`` sees each
    launch that misses the in-memory cache, and we keep its ``specialization_data`` (the signature,
    constexprs, alignment attributes and options — exactly what the JIT would compile) and return True, which
    tells Triton to skip the compile and the launch. The runner drives "dry" forwards through it at the
    shapes start-up and serving use (model_runner.precompile).
  * ``compile_all(specs, target)`` compiles those specialisations in worker subprocesses into Triton's
    on-disk cache. They are built as Triton's own ``JITFunction.preload`` builds them, so they get the same
    cache keys, and the real launches that follow are disk-cache hits (a few ms each).
  * ``WorkerPool(n)`` starts those workers ahead of time, without blocking: each imports torch, Triton and
    the kernel modules (seconds) and then waits for jobs, so the runner starts one before it loads the weights
    and the boot is off the critical path; ``compile_all(..., pool=pool)`` feeds that pool's workers.

Contract: inside ``record()`` the outputs of skipped kernels are uninitialised memory. Host code must not
branch on them, and torch ops must not index with them (onecard's ops do neither; fused_moe.route zeroes its
ids for this). ``record()`` refuses (yields None) once any onecard kernel has been compiled in this process:
a compiled kernel is not skipped and would run on the uninitialised outputs of a skipped one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Self

logger = logging.getLogger(__name__)

KERNEL_MODULES = ("onecard.kernels.gptq_gemm.triton", "onecard.kernels.gptq_gemm.small_m",
                  "onecard.kernels.fused_moe.triton", "onecard.kernels.fused_moe.decode",
                  "onecard.kernels.fused_moe.stages", "onecard.kernels.attention.triton",
                  "onecard.kernels.norm.triton", "onecard.kernels.rope.triton", "onecard.kernels.activation.triton")
MAX_WORKERS = 8                       # each imports torch (~0.4 GB, for seconds); 16 were no faster on the H200 host


@dataclass(frozen=True, slots=True)
class KernelSpec:
    module: str                       # the @triton.jit function's module ...
    name: str                         # ... and name in it
    data: str                         # Triton's specialization_data (JSON)


@dataclass(slots=True)
class Recording:
    specs: dict[str, KernelSpec] = field(default_factory=dict)
    launches: int = 0                 # skipped launches (a kernel seen twice is recorded once)

    def hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        self.launches += 1
        data = compile["specialization_data"]
        self.specs.setdefault(data, KernelSpec(fn.module, fn.name, data))
        return True                   # skip: no compile, no launch


def _jit_functions() -> list:
    from triton.runtime.jit import JITFunction

    out = []
    for name in KERNEL_MODULES:
        mod = importlib.import_module(name)
        out += [v for v in vars(mod).values() if isinstance(v, JITFunction)]
    return out


def any_compiled() -> bool:
    """True once any onecard kernel has a compiled variant in this process (the in-memory JIT cache)."""
    return any(bool(cache[0]) for fn in _jit_functions() for cache in fn.device_caches.values())


@contextlib.contextmanager
def record() -> Iterator[Recording | None]:
    """Skip and record every Triton launch inside; yields None (records nothing, skips nothing) when a kernel
    was already compiled in this process."""
    from triton import knobs

    if any_compiled() or knobs.runtime.jit_cache_hook is not None:
        yield None
        return
    rec = Recording()
    knobs.runtime.jit_cache_hook = rec.hook
    try:
        yield rec
    finally:
        knobs.runtime.jit_cache_hook = None


def parse_spec(data: str) -> tuple[dict, dict, dict, dict]:
    """-> (signature, constexprs, attrs, options) from specialization_data, as JITFunction.preload reads it."""
    import triton.language as tl
    from triton.runtime.jit import convert_to_tuple_if_list

    obj = json.loads(data)
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
        tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    return signature, constexprs, attrs, options


def compile_spec(spec: KernelSpec, target: tuple) -> tuple[str, float, str | None]:
    """Compile one specialisation for ``target`` (backend, arch, warp size) into the on-disk cache.
    -> (kernel name, seconds, error or None). Runs in a worker process; needs no GPU."""
    t0 = time.perf_counter()
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        src, options = _source(spec)
        kernel = triton.compile(src, target=GPUTarget(*target), options=options)
    except Exception as e:  # noqa: BLE001 - reported; the JIT compiles it (or raises) at the real launch
        return spec.name, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    if target[0] == "cuda":
        # The JIT also builds a C launcher per kernel signature (gcc, cached on disk by its source) at the
        # first launch; building it here takes that off the engine's start-up too. Needs libcuda: best effort.
        with contextlib.suppress(Exception):   # e.g. no libcuda on a build machine: the JIT builds it later
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(src, kernel.metadata)
    return spec.name, time.perf_counter() - t0, None


def _source(spec: KernelSpec):
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec.module), spec.name)
    signature, constexprs, attrs, options = parse_spec(spec.data)
    return ASTSource(fn, signature, constexprs, attrs), options


def is_cached(spec: KernelSpec, target: tuple) -> bool:
    """Is this specialisation in Triton's on-disk cache already? (The key triton.compile computes.)"""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    try:
        src, options = _source(spec)
    except Exception:  # noqa: BLE001 - not compilable here: the worker reports why
        return False
    backend = make_backend(GPUTarget(*target))
    extra = src.parse_options()
    key = get_cache_key(src, backend, backend.parse_options(dict(options, **extra)),
                        get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return name in group


def _cost(spec: KernelSpec) -> int:
    return 0 if ("moe" in spec.name or "w4a16" in spec.name or "attn" in spec.name) else 1


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
         "from onecard.kernels.precompile import worker_main; worker_main()")


class WorkerPool:
    """``n`` compile workers (default min(MAX_WORKERS, CPUs)), started at construction without waiting for
    them: each imports what compile_spec needs, then blocks on its first job.

    Plain subprocesses fed one JSON job per stdin line, not multiprocessing: the engine runs in a daemon
    process (server/ core_client), and daemon processes may not have multiprocessing children. The owner
    closes it (``close()`` or ``with``) in every case: close() ends each worker (EOF on its stdin; killed if
    it does not exit) and reaps it. A worker whose parent dies also gets EOF and exits: no orphans."""

    def __init__(self, n: int | None = None):
        self.procs: list[subprocess.Popen] = []
        try:
            for _ in range(max(1, n or min(MAX_WORKERS, available_cpus()))):
                self.procs.append(subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path)],
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout: float = 60.0) -> None:
        """End and reap every worker; idempotent. A worker still booting finishes its imports first."""
        for p in self.procs:
            with contextlib.suppress(OSError):                            # it may be gone already
                p.stdin.close()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


def compile_all(specs: list[KernelSpec], target: tuple, workers: int | None = None,
                pool: WorkerPool | None = None) -> dict:
    """Compile the uncached ``specs`` in parallel worker processes. -> summary dict for the log/bench.

    With ``pool``, its running workers do it (``workers`` is ignored; the caller owns and closes the pool).
    Without, it starts min(``workers`` or MAX_WORKERS, CPUs, uncached specs) workers and closes them."""
    t0 = time.perf_counter()
    total = len(specs)
    specs = [s for s in specs if not is_cached(s, target)]
    if not specs:
        summary = {"workers": 0, "compile_seconds_sum": 0.0, "errors": []}
    elif pool is not None:
        summary = _compile(specs, target, pool.procs[:len(specs)])
    else:
        with WorkerPool(min(workers or MAX_WORKERS, available_cpus(), len(specs))) as own:
            summary = _compile(specs, target, own.procs)
    for e in summary["errors"]:
        logger.warning("precompile: %s (the JIT compiles it at its first launch)", e)
    return {"kernels": total, "compiled": len(specs), "seconds": time.perf_counter() - t0, **summary}


def _compile(specs: list[KernelSpec], target: tuple, procs: list[subprocess.Popen]) -> dict:
    """One thread per worker, each feeding its worker one job at a time from a shared queue."""
    jobs: queue.Queue = queue.Queue()
    for s in sorted(specs, key=_cost):                                    # heavy kernels first
        jobs.put(s)
    results: list[tuple[str, float, str | None]] = []

    def drive(proc: subprocess.Popen) -> None:
        while True:
            try:
                spec = jobs.get_nowait()
            except queue.Empty:
                return
            line: str | None = ""
            try:
                proc.stdin.write(json.dumps({"spec": dataclasses.asdict(spec), "target": list(target)}) + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):                                 # it died, or was closed
                line = None
            while line is not None and not line.startswith(_REPLY):
                line = proc.stdout.readline() or None                     # skip anything else it prints
            if line is None:
                results.append((spec.name, 0.0, "the compile worker exited"))
                return                                                    # the other workers take the rest
            results.append(tuple(json.loads(line[len(_REPLY):])))

    threads = [threading.Thread(target=drive, args=(p,), name=f"precompile-{i}", daemon=True)
               for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [f"{name}: {err[:300]}" for name, _, err in results if err]
    while not jobs.empty():                                               # every worker exited
        errors.append(f"{jobs.get_nowait().name}: not compiled (no compile worker left)")
    return {"workers": len(procs), "compile_seconds_sum": sum(r[1] for r in results), "errors": errors}


_REPLY = "@@onecard-precompile "


def _preimport() -> None:
    """What compile_spec and _source import, so the first job does not pay for it (a WorkerPool worker does
    this while the engine loads weights). Best effort: a failure shows up in that job's reply."""
    for name in ("triton", "triton.compiler", "triton.backends.nvidia.driver", *KERNEL_MODULES):
        with contextlib.suppress(Exception):   # e.g. no NVIDIA backend here
            importlib.import_module(name)


def worker_main() -> None:
    """A compile worker: imports first (_preimport), then one JSON job per stdin line -> one reply line per
    job on stdout (prefixed _REPLY: an import may print to stdout too). Exits at EOF on stdin."""
    _preimport()
    for line in sys.stdin:
        job = json.loads(line)
        name, sec, err = compile_spec(KernelSpec(**job["spec"]), tuple(job["target"]))
        sys.stdout.write(_REPLY + json.dumps([name, sec, err]) + "\n")
        sys.stdout.flush()


def current_target() -> tuple:
    from triton.runtime import driver

    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


__all__ = [
    "KernelSpec",
    "Recording",
    "WorkerPool",
    "any_compiled",
    "available_cpus",
    "compile_all",
    "compile_spec",
    "current_target",
    "is_cached",
    "parse_spec",
    "record",
    "worker_main",
]
