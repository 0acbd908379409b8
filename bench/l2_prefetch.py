"""L2 prefetch A/B (issue 25 item 2, ONECARD_L2_PREFETCH): decode with the next layer's dense weights streamed
into L2 during each layer's MoE vs without, on one engine, plus the kernel-level figure behind it.

Engine part: one EngineCore over the full-size checkpoint (the deployment's async loop), one set of decode CUDA
graphs captured per mode ("off", "l2", "evict_last": the prefetcher built by ``model.enable_l2_prefetch``, as the
runner does from the environment); the modes alternate (the order flips every repeat), REPEATS runs per batch
size (1 and 16), 512-token prompts, NEW greedy tokens (ignore_eos), TPOT = (last - first token) / (NEW - 1),
medians with min/max; the same prompts must give the same tokens in every mode (``tokens_equal``). Then the GPU
time of one decode step alone: the batch-1 and batch-16 graphs replayed back to back (CUDA events, no host in
it), modes alternating, medians.
Kernel part: the qkv GEMV (layer 1's weights, M = 1) inside CUDA graphs of COPIES iterations each: L2 flushed
first (a 2 x L2 buffer rewritten), then the GEMV ("cold"); flushed, the weights prefetched by the kernel, a
spin of ~SPIN_US, then the GEMV ("prefetched"; "prefetched_evict_last" the same with evict_last); the GEMV back
to back with its weights resident ("hot"). Each GEMV time is a graph minus the same graph without the GEMV.
Writes OUT (JSON) and prints it.

Usage (repo root, a GPU, after ``python bench/full_size.py build /tmp/q30``; ``bash bench/run_h200.sh l2prefetch``):
  python bench/l2_prefetch.py /tmp/q30 $OUT/l2_prefetch.json
On the CPU (a smoke run of the same A/B code: reference kernels, no graphs, no kernel part, short runs):
  python bench/l2_prefetch.py --cpu onecard/data/onecard-tiny-coder OUT.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("off", "l2", "evict_last")
REPEATS = 3
PROMPT, NEW = 512, 256
COPIES, REPLAYS, SPIN_US = 20, 20, 20.0


def engine(model_dir: str, cpu: bool):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    if cpu:
        args = {"model": model_dir, "device": "cpu", "max_model_len": 256, "max_num_seqs": 16}
    else:
        args = {"model": model_dir, "quantization": "gptq", "dtype": "float16", "max_model_len": 8192,
                "max_num_seqs": 16, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9,
                "enable_prefix_caching": False}
    return EngineCore(EngineArgs(**args).create_config())


class Modes:
    """One prefetcher and one set of decode graphs per mode on one engine; ``use(mode)`` makes it live."""

    def __init__(self, core):
        self.core, self.graphs, self.prefetchers = core, {}, {}
        runner, model = core.runner, core.runner.model
        for mode in MODES:
            model.l2_prefetch = None if mode == "off" else model.enable_l2_prefetch(mode, runner.device)
            self.prefetchers[mode] = model.l2_prefetch
            if getattr(runner, "graphs", None) is not None:              # GPU: capture with this mode
                runner.capture_graphs()
                self.graphs[mode] = runner.graphs
        self.use("off")

    def use(self, mode: str) -> None:
        self.core.runner.model.l2_prefetch = self.prefetchers[mode]
        if mode in self.graphs:
            self.core.runner.graphs = self.graphs[mode]

    def describe(self) -> dict:
        return {m: (p.describe() if p is not None else "off") for m, p in self.prefetchers.items()}


def run(core, prompts: list[list[int]], new: int) -> tuple[list[float], list[list[int]]]:
    """-> (each token's arrival time over all requests, each request's tokens in prompt order)."""
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    tag = time.time_ns()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{tag}-{i}", p, sp, time.monotonic(), []))
    arrivals: list[float] = []
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        outs = core.step()
        now = time.perf_counter()
        for o in outs:
            arrivals += [now] * len(o.new_token_ids)
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return arrivals, [tokens[f"r{tag}-{i}"] for i in range(len(prompts))]


def _stats(bs: int, tpots: list[float]) -> dict:
    med = statistics.median(tpots)
    return {"tok_s": bs / med, "tpot_ms": med * 1e3, "tok_s_min": bs / max(tpots), "tok_s_max": bs / min(tpots)}


def decode_ab(core, modes: Modes, bs: int, prompt: int, new: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(bs)]
    tpots: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[list[list[int]]]] = {m: [] for m in MODES}
    for rep in range(REPEATS):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            modes.use(mode)
            arrivals, toks = run(core, prompts, new)
            per_seq_first = sorted(arrivals)[bs - 1]                      # every sequence's first token is out
            tpots[mode].append((max(arrivals) - per_seq_first) / (new - 1))
            tokens[mode].append(toks)
    modes.use("off")
    ref = tokens["off"][0]
    out: dict = {m: _stats(bs, v) for m, v in tpots.items()}
    out["tokens_equal_by_mode"] = {m: all(t == ref for t in runs) for m, runs in tokens.items()}   # vs off's 1st
    out["tokens_equal"] = all(out["tokens_equal_by_mode"].values())
    for m in MODES[1:]:
        out[f"{m}_vs_off"] = out[m]["tok_s"] / out["off"]["tok_s"]
    return out


def graph_step_us(modes: Modes, bs: int, rounds: int = 5, replays: int = 50) -> dict:
    """GPU time of one decode step (the bs graph replayed back to back), modes alternating: medians in µs."""
    from kernels_gpu import replay_us

    got: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            got[mode].append(replay_us(modes.graphs[mode].graphs[bs], replays))
    return {m: statistics.median(v) for m, v in got.items()}


def _time_graph(fn) -> float:
    """Microseconds per call of ``fn`` captured COPIES times in one CUDA graph (bench/kernels_gpu.py's timer)."""
    from kernels_gpu import bench_graph

    return bench_graph(fn, COPIES, REPLAYS)


def kernel_figure(model, device: torch.device) -> dict:
    from onecard.kernels import dispatch as ops
    from onecard.kernels import paths
    from onecard.kernels.prefetch.table import prefetch_table, table_bytes

    lin = model.layers[1].self_attn.qkv_proj
    w = lin.gptq
    x = torch.randn(1, w.in_features, dtype=torch.float16, device=device)
    table = prefetch_table(lin.tensors(), device)
    l2 = paths.l2_cache_bytes(device.index or 0) or (50 << 20)
    flush = torch.zeros(2 * l2, dtype=torch.uint8, device=device)
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 1_980_000)   # H100 SXM boost if absent
    spin = int(SPIN_US * 1e-6 * khz * 1e3)

    def evict():
        flush.add_(1)                                       # 2 x L2 of read + write: nothing else stays

    def gemv():
        ops.w4a16_gemm(x, w)

    def pre(evict_last: bool):
        def f():
            evict()
            ops.l2_prefetch(table, evict_last)
            torch.cuda._sleep(spin)
        return f

    def then(f, g):
        def h():
            f()
            g()
        return h

    res = {"bytes": table_bytes(table), "rows": int(table.shape[0]), "spin_us": SPIN_US, "l2_bytes": l2}
    evict_only = _time_graph(evict)
    res["cold_us"] = _time_graph(then(evict, gemv)) - evict_only
    for name, el in (("prefetched_us", False), ("prefetched_evict_last_us", True)):
        base = _time_graph(pre(el))
        res[name] = _time_graph(then(pre(el), gemv)) - base
        res[name.replace("_us", "_base_us")] = base
    res["hot_us"] = _time_graph(gemv)
    res["evict_us"] = evict_only
    res["prefetch_kernel_alone_us"] = _time_graph(lambda: ops.l2_prefetch(table))
    return res


def main(argv: list[str]) -> dict:
    cpu = "--cpu" in argv
    args = [a for a in argv if a != "--cpu"]
    if len(args) != 2:
        raise SystemExit(__doc__)
    model_dir, out = args
    t0 = time.perf_counter()
    core = engine(model_dir, cpu)
    res: dict = {"ready_s": time.perf_counter() - t0}
    if not cpu:
        from full_size import capability_record
        res["paths"] = capability_record()
        res["device"] = torch.cuda.get_device_name()
    modes = Modes(core)
    res["modes"] = modes.describe()
    vocab = int(core.config.model.hf_config["vocab_size"])
    prompt, new = (24, 6) if cpu else (PROMPT, NEW)
    run(core, [torch.randint(3, vocab, (64,)).tolist()], 8)               # warm-up
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    parts = [(f"decode_bs{bs}", lambda bs=bs: decode_ab(core, modes, bs, prompt, new, vocab, seed=bs)) for bs in (1, 16)]
    if not cpu:
        parts += [("graph_step_us", lambda: {f"bs{bs}": graph_step_us(modes, bs) for bs in (1, 16)}),
                  ("qkv_gemv", lambda: kernel_figure(core.runner.model, core.runner.device))]
    for name, part in parts:                  # each part's result is written as soon as it exists
        try:
            res[name] = part()
        except Exception as e:                # keep what the other parts measured
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(name, json.dumps(res[name]), flush=True)
        res["total_s"] = time.perf_counter() - t0
        Path(out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1), flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
