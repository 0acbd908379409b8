"""Issue 29 item 1: which consumer of the compute capability made decode look 1.2-1.4x faster when torch reported
sm80 (shared/leads/capability_ab.py)? Each consumer is switched ALONE to its sm80 answer, the rest native, on one
engine in one process; configurations alternate (order flipped every round), several rounds; each is measured
the lead's way and warmed.

The consumers (``--list`` prints them from the installed sources, on the CPU):
  onecard   every decision asks kernels/paths.capability() (device_props: torch.cuda.get_device_properties, read
            once and cached); of paths' decisions only ``use_pdl`` and ``grouped_gemm_dtype`` answer differently at
            80 than at 90 (``decision_diff``, computed, and pinned by tests/unit/test_capability_bisect.py):
    pdl80        paths.use_pdl answers for 80: no programmatic dependent launch (decode graphs recaptured)
    grouped80    paths.grouped_gemm_dtype answers for 80: the prefill MoE's grouped GEMM in fp16 (PyTorch's
                 host-looped fallback, a cuBLAS call per expert) instead of bf16 (CUTLASS)
    onecard80    paths.set_emulated_capability(80): all of onecard's decisions at once (= pdl80 + grouped80)
  torch     Python callers of torch.cuda.get_device_capability / get_device_properties at run time. In torch
            2.13 these are chiefly ``torch._native``'s Python overrides of aten ops (a condition asked on every
            call; e.g. fused RMSNorm for major 9/10, scatter_add for sm90+, bmm outer products), installed at
            ``import torch``. C++ choices (cuBLAS/cuBLASLt heuristics, SDPA backend, _grouped_mm) read the
            properties in C++ and cannot follow a Python patch, so they cannot explain the lead's figure.
    torch80      torch.cuda.get_device_capability / get_device_properties answer 8.0 (onecard keeps its cached
                 native answer; Triton's target pinned, as the lead did) (graphs recaptured)
    torch_native_off  torch._native's overrides deregistered (what their capability conditions turn off)
  Triton    asks torch.cuda.get_device_capability, bound once at driver start (GPUDriver.get_device_capability),
            for its compile target; an sm80 cubin cannot load on sm90, so the target is not a candidate: the
            lead pinned it. ``triton_pin`` is that pin alone (the lead's control).
  lead80    torch80 + onecard80: the lead's "report 8.0"; the best-known configuration of the issue.

Per configuration and round, on fresh random prompts (prefix caching off, as the lead):
  naive   = bs*128 / (t2 - t1_first)  the lead's figure: t1 = first run of the prompts + 1 token, t2 = + 129 tokens
  warmed  = bs*128 / (t2 - t1_again)  t1 repeated after t2 (no first-run costs in it)
  arrival = bs*128 / (last token - first token) of the t2 run (bench/full_size.py's method)
The hypothesis under test: the lead's gain is first-run cost of the fp16 grouped-GEMM prefill landing in t1
(naive up, warmed/arrival not). Then a profile: per-kernel decode time inside the CUDA graph, native vs lead80
(bench/profile_decode.profile), and a host+device profile of t1's prefill on its first and second run, native vs
grouped80. ``guard`` (issue 29 item 3): the native figure next to the best configuration of this call.

Usage (repo root, on the GPU, after ``python bench/full_size.py build DIR``):
  python bench/capability_bisect.py DIR OUT.json [--rounds 3] [--configs native,pdl80,...] [--no-profile]
  python bench/capability_bisect.py --list [OUT.json]        the consumers and the decision diff (CPU)
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = ("native", "triton_pin", "pdl80", "grouped80", "torch80", "torch_native_off", "onecard80", "lead80")
RECAPTURE = {"pdl80", "torch80", "torch_native_off", "onecard80", "lead80", "native"}
NEW = 128                                          # decode tokens measured per run (t2 = prompt + NEW + 1)


# ---------------------------------------------------------------- CPU part: the consumers
def decision_diff(cc_a: int = 90, cc_b: int = 80) -> dict[str, str]:
    """paths' decisions whose answer differs between capabilities ``cc_a`` and ``cc_b``: name -> an example."""
    from onecard.kernels import paths

    dts = ("float16", "bfloat16", "float32")
    probes = {
        "tensor_core_dot": [()], "bf16_allowed": [()], "dense_cublas_min_m": [()], "per_expert_moe": [()],
        "choose_dense_gemm": [(m,) for m in range(1, 1025)],
        "choose_decode_moe": [(t,) for t in range(1, paths.DECODE_MAX_TOKENS + 1)],
        "triton_moe_config": [(t,) for t in range(1, 1025)],
        "choose_moe": [(t,) for t in range(1, 1025)],
        "attention_tiles": [(bm,) for bm in (16, 64)],
    }
    out: dict[str, str] = {}
    for name, calls in probes.items():
        fn = getattr(paths, name)
        for args in calls:
            a, b = (fn(*args, cc) if args or name != "attention_tiles" else fn(cc) for cc in (cc_a, cc_b))
            if a != b:
                out[name] = f"{name}{args}: {a!r} at {cc_a}, {b!r} at {cc_b}"
                break
    for act in dts:
        a, b = (paths.grouped_gemm_dtype(act, cc, dts) for cc in (cc_a, cc_b))
        if a != b:
            out["grouped_gemm_dtype"] = f"grouped_gemm_dtype({act!r}): {a} at {cc_a}, {b} at {cc_b}"
            break
    for n in range(1, 17):
        for most in (1, 16):
            a, b = (paths.use_pdl(n, cc, most) for cc in (cc_a, cc_b))
            if a != b and "use_pdl" not in out:
                out["use_pdl"] = f"use_pdl({n} tokens, max {most}): {a} at {cc_a}, {b} at {cc_b}"
    for bs in range(1, 17):
        for bound in (1024, 8192, 66560):
            a, b = (paths.split_kv(bs, True, bound, 4, 132, cc, "fill") for cc in (cc_a, cc_b))
            if a != b and "split_kv" not in out:
                out["split_kv"] = f"split_kv(bs {bs}, bound {bound}): {a} at {cc_a}, {b} at {cc_b}"
    return out


def _callers(root: Path, pattern: str, skip: tuple[str, ...] = ()) -> dict[str, int]:
    rx = re.compile(pattern)
    hits: dict[str, int] = {}
    for f in sorted(root.rglob("*.py")):
        rel = str(f.relative_to(root))
        if any(s in rel for s in skip):
            continue
        try:
            n = len(rx.findall(f.read_text(errors="ignore")))
        except OSError:
            continue
        if n:
            hits[rel] = n
    return hits


def consumers() -> dict:
    """Who asks for the capability: onecard (its one function and the callers of it), torch's and Triton's
    Python callers of torch.cuda.get_device_capability / get_device_properties, torch._native's overrides."""
    import torch
    import triton

    here = Path(__file__).resolve().parent.parent / "onecard"
    cap = r"get_device_capability|get_device_properties"
    res = {
        "onecard_asks_torch": _callers(here, cap),
        "onecard_asks_paths": _callers(here, r"paths\.capability\(|compute_capability\(|paths\.device_props\("),
        "torch_python_callers": _callers(Path(torch.__file__).parent, cap,
                                         skip=("testing/", "_inductor/", "_dynamo/", "test", "benchmark",
                                               "collect_env", "cpp_extension", "_vendor/quack/bench")),
        "triton_python_callers": _callers(Path(triton.__file__).parent, r"torch\.cuda\.get_device_capability|"
                                          r"torch\.cuda\.get_device_properties"),
        "decisions_differing_90_vs_80": decision_diff(90, 80),
    }
    try:
        from torch._native import registry

        res["torch_native_overrides"] = sorted(
            f"{op} [{key}] {node.dsl_name}{'' if node.active else ' (inactive)'}"
            for (op, key), nodes in registry._graphs.items() for node in nodes)
    except (ImportError, AttributeError) as e:
        res["torch_native_overrides"] = f"not available here: {e!r}"
    return res


# ---------------------------------------------------------------- GPU part: toggles
class Toggles:
    """Applies one configuration's patches and reverts them."""

    def __init__(self) -> None:
        self._undo: list = []
        self.target = None                                               # Triton's, read before any torch patch

    def _set(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def apply(self, config: str) -> None:
        import torch
        from triton.runtime import driver

        from onecard.kernels import paths

        if config in ("triton_pin", "torch80", "lead80"):
            if self.target is None:
                self.target = driver.active.get_current_target()
            target = self.target
            self._set(driver.active, "get_current_target", lambda: target)
        if config in ("torch80", "lead80"):
            real_props = torch.cuda.get_device_properties

            class _Props:
                major, minor = 8, 0

                def __init__(self, p):
                    self._p = p

                def __getattr__(self, k):
                    return getattr(self._p, k)

            self._set(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))
            self._set(torch.cuda, "get_device_properties", lambda *a, **k: _Props(real_props(*a, **k)))
        if config == "pdl80":
            use_pdl = paths.use_pdl
            self._set(paths, "use_pdl", lambda n, cc, most: use_pdl(n, 80, most))
        if config == "grouped80":
            gdt = paths.grouped_gemm_dtype
            self._set(paths, "grouped_gemm_dtype", lambda act, cc, sup: gdt(act, 80, sup))
        if config in ("onecard80", "lead80"):
            paths.set_emulated_capability(80)
            self._undo.append((None, "emulation", None))
        if config == "torch_native_off":
            from torch._native import registry

            names = sorted({n.dsl_name for nodes in registry._graphs.values() for n in nodes})
            registry.deregister_op_overrides(disable_dsl_names=names)
            self._undo.append((registry, "reenable", names))

    def revert(self) -> None:
        from onecard.kernels import paths

        for obj, name, old in reversed(self._undo):
            if name == "emulation":
                paths.set_emulated_capability(None, clear=True)
            elif name == "reenable":
                obj.reenable_op_overrides(enable_dsl_names=old)
            else:
                setattr(obj, name, old)
        self._undo.clear()


# ---------------------------------------------------------------- GPU part: measurements
def _total(times: dict[str, list[float]]) -> float:
    return max(t[-1] for t in times.values())


def measure(core, g, ctx: int = 512, prefill: int = 4096) -> dict:
    """Decode bs1 / bs16 the lead's way (naive), warmed and by arrival on fresh prompts; prefill 4k first/again."""
    import torch

    from bench.full_size import V, _run

    res: dict = {}
    for bs in (1, 16):
        ps = [torch.randint(0, V, (ctx,), generator=g).tolist() for _ in range(bs)]
        t1_first = _total(_run(core, ps, 1))
        times = _run(core, ps, NEW + 1)
        t2 = _total(times)
        first, last = max(t[0] for t in times.values()), max(t[-1] for t in times.values())
        t1_again = _total(_run(core, ps, 1))
        res[f"bs{bs}"] = {"naive": bs * NEW / (t2 - t1_first), "warmed": bs * NEW / (t2 - t1_again),
                          "arrival": bs * NEW / (last - first), "t1_first_ms": t1_first * 1e3,
                          "t1_again_ms": t1_again * 1e3, "t2_ms": t2 * 1e3}
    p = [torch.randint(0, V, (prefill,), generator=g).tolist()]
    res["prefill4k_first"] = prefill / _total(_run(core, p, 1))
    res["prefill4k_again"] = prefill / _total(_run(core, p, 1))
    return res


def summarize(runs: list[dict], configs: list[str]) -> dict:
    out: dict = {}
    for c in configs:
        mine = [r for r in runs if r["config"] == c]
        row: dict = {}
        for bs in ("bs1", "bs16"):
            for k in ("naive", "warmed", "arrival", "t1_first_ms", "t1_again_ms"):
                vals = [r[bs][k] for r in mine]
                row[f"{bs}_{k}"] = statistics.median(vals)
                row[f"{bs}_{k}_range"] = [min(vals), max(vals)]
        for k in ("prefill4k_first", "prefill4k_again"):
            row[k] = statistics.median(r[k] for r in mine)
        out[c] = row
    return out


def guard(summary: dict) -> dict:
    """Issue 29 item 3: the native figure next to the best configuration measured in the same call (warmed
    and arrival medians; the naive one is the artifact under test)."""
    out: dict = {}
    for bs in ("bs1", "bs16"):
        for k in ("arrival", "warmed"):
            key = f"{bs}_{k}"
            best = max(summary, key=lambda c: summary[c][key])
            nat = summary.get("native", {}).get(key)
            out[key] = {"native": nat, "best": best, "best_value": summary[best][key],
                        "lead80": summary.get("lead80", {}).get(key),
                        "native_vs_best": None if nat is None else nat / summary[best][key]}
    out["ok"] = all(v["native_vs_best"] is not None and v["native_vs_best"] >= 0.97
                    for k, v in out.items() if isinstance(v, dict))
    return out


def first_run_profile(core, g, ctx: int = 512, bs: int = 16) -> dict:
    """Host and device time of t1 (prompt + 1 token) on fresh prompts: its first and its second run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.full_size import V, _run

    ps = [torch.randint(0, V, (ctx,), generator=g).tolist() for _ in range(bs)]
    out = {}
    for label in ("first", "again"):
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _run(core, ps, 1)
        wall = time.perf_counter() - t0
        ka = prof.key_averages()
        top_cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]
        top_dev = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:15]
        out[label] = {"wall_ms": wall * 1e3,
                      "top_self_cpu_us": [(e.key[:80], e.count, e.self_cpu_time_total) for e in top_cpu],
                      "top_self_device_us": [(e.key[:80], e.count, getattr(e, "self_device_time_total", 0))
                                             for e in top_dev]}
    return out


def main(argv: list[str]) -> dict:
    import torch

    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    configs = argv[argv.index("--configs") + 1].split(",") if "--configs" in argv else list(CONFIGS)
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; one of {CONFIGS}")
    try:                                    # torch < 2.13 (the device's 2.11) has no torch._native overrides
        import torch._native
    except ImportError:
        configs = [c for c in configs if c != "torch_native_off"]
    model_dir, out = [a for i, a in enumerate(argv) if not a.startswith("--")
                      and (i == 0 or argv[i - 1] not in ("--rounds", "--configs"))][:2]
    from bench.full_size import _engine, _run, capability_record

    t0 = time.perf_counter()
    toggles = Toggles()
    core, ready = _engine(model_dir)
    runner = core.runner
    res: dict = {"paths": capability_record(), "time_to_ready_s": ready, "consumers": consumers(),
                 "configs": configs, "rounds": rounds, "runs": []}
    print(json.dumps(res["consumers"]["decisions_differing_90_vs_80"]), flush=True)
    g = torch.Generator().manual_seed(7)
    _run(core, [torch.randint(0, 1000, (64,), generator=g).tolist()], 8)      # warm-up, as the lead
    graphs = {}
    for c in configs:                                                    # one graph set per configuration
        if c in RECAPTURE and getattr(runner, "graphs", None) is not None:
            toggles.apply(c)
            try:
                runner.capture_graphs()
                graphs[c] = runner.graphs
            finally:
                toggles.revert()
    native_graphs = graphs.get("native", getattr(runner, "graphs", None))
    for rnd in range(rounds):
        for c in (configs if rnd % 2 == 0 else configs[::-1]):
            runner.graphs = graphs.get(c, native_graphs)
            toggles.apply(c)
            try:
                t = time.perf_counter()
                r = measure(core, g)
            finally:
                toggles.revert()
            r.update(config=c, round=rnd, wall_s=time.perf_counter() - t)
            res["runs"].append(r)
            print(json.dumps({"config": c, "round": rnd, **{bs: {k: round(v, 1) for k, v in r[bs].items()}
                                                             for bs in ("bs1", "bs16")}}), flush=True)
    runner.graphs = native_graphs
    res["summary"] = summarize(res["runs"], configs)
    res["guard"] = guard(res["summary"])
    if "--no-profile" not in argv:
        from bench.profile_decode import profile

        res["profile"] = {}
        for c in ("native", "lead80"):
            toggles.apply(c)
            try:
                res["profile"][c] = [{k: (v[:30] if isinstance(v, list) else v) for k, v in profile(runner, bs).items()}
                                     for bs in (1, 16)]
            finally:
                toggles.revert()
        res["first_run_profile"] = {}
        for c in ("native", "grouped80"):
            toggles.apply(c)
            try:
                res["first_run_profile"][c] = first_run_profile(core, g)
            finally:
                toggles.revert()
    res["wall_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(res, indent=1, default=str))
    print(f"{'config':18s} {'bs1 naive':>10s} {'warmed':>8s} {'arrival':>8s} {'bs16 naive':>11s} {'warmed':>8s} "
          f"{'arrival':>8s} {'t1 1st/2nd ms (bs16)':>22s} {'pf4k':>7s}")
    for c, s in res["summary"].items():
        print(f"{c:18s} {s['bs1_naive']:10.1f} {s['bs1_warmed']:8.1f} {s['bs1_arrival']:8.1f} "
              f"{s['bs16_naive']:11.1f} {s['bs16_warmed']:8.1f} {s['bs16_arrival']:8.1f} "
              f"{s['bs16_t1_first_ms']:10.1f}/{s['bs16_t1_again_ms']:<10.1f} {s['prefill4k_again']:7.0f}")
    print("guard:", json.dumps(res["guard"]))
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--list"]:
        info = consumers()
        text = json.dumps(info, indent=1)
        if len(args) > 1:
            Path(args[1]).write_text(text)
        print(text)
    elif len(args) < 2:
        raise SystemExit(__doc__)
    else:
        main(args)
