"""Decode speed at the context lengths coding agents run (issue 25 item 3), against the bandwidth floor.

Scenarios (batch, context tokens per sequence): (1, 512), (1, 32768), (1, 65536), (16, 512), (16, 8192); the
512-token ones in the same process give the ratios the issue's targets are written in (32k at batch 1 >= 85%
of the 512 figure, 8k at batch 16 >= 80%). Each scenario: the contexts are prefilled once (chunked, prefix
caching on), then DECODE_REPEATS runs of ``new`` greedy tokens re-send the same prompts: the prefix cache
serves every full block, so a run is the decode of ``new`` tokens at that context (plus one short prefill).
TPOT = (last token - first token) / (new - 1); the median of the repeats is reported with min and max.
Floor: bytes one step reads (bench/full_size.step_bytes: weights of the step, 2.1 GB at batch 1, plus every
sequence's KV, 98,304 B per token) over the device's copy bandwidth; ``floor_fraction`` = floor / TPOT.

Split-KV A/B (issue 25 item 3): ``--policies legacy,fill`` (the default) measures every scenario under each
split-KV policy of kernels/paths.split_kv in the same process, on the same engine and prompts: one set of CUDA
graphs is captured per policy (the segment count is fixed at capture), and the repeats alternate policies
(legacy, fill, legacy, fill, ...; the order flips every repeat). ``fill:N`` is "fill" with N resident programs
per SM instead of paths.SPLIT_CTAS_PER_SM (a sweep of the one tunable). Each row reports the segments the
graph's attention launches with and how many of them the context fills. ``--sweep attn_sweep.json`` adds the
policies "sweep:1x32k" and "sweep:16x8k": "fill" with the decode-attention knobs bench/attn_sweep.py found fastest
for that case (kernels/paths.set_decode_attention_override; forced segment counts are not carried over).
Every row reports whether its greedy tokens equal the first policy's, and the tokens (the first repeat's).
``--scenarios 1x512,1x32768`` keeps only those (batch x context) scenarios. A spec "POLICY+SWITCH+..." turns
decode-path switches on for that policy's graphs (SWITCHES: kernels/paths.py's on/off switches and two config
entries), so ``--policies fill,fill+int_dot+moe_act`` A/Bs them in one engine, alternating.

Usage (repo root, a GPU, the checkpoint of ``python bench/full_size.py build /tmp/q30``):
  python bench/long_context.py /tmp/q30 OUT.json [--policies legacy,fill,fill:5] [--sweep attn_sweep.json]
  ONECARD_EMULATE_CC=70 python bench/long_context.py /tmp/q30 OUT.json   # the pre-sm80 branches on this card
On the CPU (a smoke run of the same code with tiny contexts, no floor, no graphs, reference kernels):
  python bench/long_context.py --cpu onecard/data/onecard-tiny-coder OUT.json
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

from full_size import DECODE_REPEATS, KV_BYTES_PER_TOKEN, V, capability_record, copy_bandwidth, step_bytes
from policy_switches import SWITCHES, set_switches, switch_setters

SCENARIOS = ((1, 512), (1, 32768), (1, 65536), (16, 512), (16, 8192))
CPU_SCENARIOS = ((1, 48), (1, 160), (4, 48), (4, 96))
NEW_TOKENS = 128


def engine(model_dir: str, max_ctx: int, cpu: bool):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    if cpu:
        args = {"model": model_dir, "device": "cpu", "max_model_len": max_ctx + 64, "max_num_seqs": 16,
                "max_num_batched_tokens": 512, "enable_prefix_caching": True}
    else:
        # 65,536 tokens of context plus the decoded ones; chunked prefill of 8,192 per step (the deployment's)
        args = {"model": model_dir, "quantization": "gptq", "dtype": "float16", "max_model_len": max_ctx + 1024,
                "max_num_seqs": 16, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9,
                "enable_prefix_caching": True}
    return EngineCore(EngineArgs(**args).create_config())


def run(core, prompts: list[list[int]], new: int, tokens: list[list[int]] | None = None) -> list[list[float]]:
    """Greedy ``new`` tokens for each prompt; each request's token arrival times (s after adding). ``tokens``:
    a list to append each request's generated ids to."""
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        ids.append(f"lc{time.time_ns()}-{i}")
        core.add_request(EngineRequest(ids[-1], p, sp, time.monotonic(), []))
    times: dict[str, list[float]] = {}
    toks: dict[str, list[int]] = {}
    cuda = core.runner.device.type == "cuda"
    while core.has_unfinished():
        outs = core.step()
        if cuda and not core.async_scheduling:
            torch.cuda.synchronize()
        now = time.perf_counter() - t0
        for o in outs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    if tokens is not None:
        tokens.extend(toks[i] for i in ids)
    return [times[i] for i in ids]


def tpot(times: list[list[float]]) -> float:
    """Seconds per decode step once every sequence is decoding: from the last first token to the last token."""
    first = max(t[0] for t in times)
    last = max(t[-1] for t in times)
    steps = max(len(t) for t in times) - 1
    return (last - first) / max(steps, 1)


# "sweep:CASE" policies: the fill policy with the decode-attention knobs that bench/attn_sweep.py found fastest
# for CASE (``--sweep attn_sweep.json``); filled by sweep_knobs()
SWEEP_KNOBS: dict[str, dict] = {}
SHAPE_FREE = ("segments", "min_seg_tiles")      # forced split counts fit one launch shape only: not carried over


def sweep_knobs(path: str, cases=("1x32k", "16x8k")) -> list[str]:
    """The "sweep:CASE" policies of an attn_sweep.json: per case its fastest point (the contiguous-table control
    and points off the default's output excluded) without the shape-bound knobs (SHAPE_FREE)."""
    data = json.loads(Path(path).read_text())
    specs = []
    for case in cases:
        rows = [r for r in data.get("rows", []) if r.get("case") == case and "us" in r
                and r.get("phase") != "contiguous-blocks" and not set(r.get("knobs", {})) & set(SHAPE_FREE)
                and r.get("max_diff", 0.0) <= 1e-2]
        if rows:
            best = min(rows, key=lambda r: r["us"])
            SWEEP_KNOBS[case] = dict(best["knobs"])
            specs.append(f"sweep:{case}")
    return specs


def parse_policy(spec: str) -> tuple[str, int | None]:
    """"fill" -> ("fill", None); "fill:5" -> ("fill", 5); "legacy" -> ("legacy", None); "sweep:CASE" -> ("fill",
    None) (its knobs: SWEEP_KNOBS[CASE], set by Policies). "POLICY+SWITCH+...": the policy with those switches
    on, "+no_SWITCH" off (SWITCHES; one set of graphs each, so an A/B of the switches runs in one engine)."""
    from onecard.kernels import paths

    spec, *switches = spec.split("+")
    if not SWITCHES:
        SWITCHES.update(switch_setters())
    for sw in switches:
        if sw.removeprefix("no_") not in SWITCHES:
            raise SystemExit(f"--policies: +{sw} is not one of {sorted(SWITCHES)} (or no_ one of them)")
    name, _, n = spec.partition(":")
    if name == "sweep":
        if n not in SWEEP_KNOBS:
            raise SystemExit(f"--policies: {spec!r}: no knobs for {n!r} (give --sweep attn_sweep.json)")
        return "fill", None
    if name not in paths.SPLIT_KV_POLICIES or (n and not n.isdigit()):
        raise SystemExit(f"--policies: {spec!r} is not one of {paths.SPLIT_KV_POLICIES} (optionally NAME:N)")
    return name, int(n) if n else None


def main_policy(specs: list[str]) -> str:
    """The policy the top-level figures report: the default ("fill") where measured, else the last one."""
    return "fill" if "fill" in specs else specs[-1]


class Policies:
    """One set of CUDA graphs per split-KV policy on one engine; ``use(spec)`` makes that policy live."""

    def __init__(self, core, specs: list[str]):
        from onecard.kernels import paths

        self.core, self.specs, self.graphs = core, specs, {}
        runner = core.runner
        for spec in specs:
            self._set(spec)
            if getattr(runner, "graphs", None) is not None:              # GPU: capture under this policy
                runner.capture_graphs()
                self.graphs[spec] = runner.graphs
                st = runner.graphs.capture_stats
                print(f"policy {spec}: {st.get('decode_graphs', 0):.0f} decode graphs captured in "
                      f"{st.get('decode_s', 0.0):.2f} s, {st.get('decode_bytes', 0.0) / 2**20:.0f} MiB", flush=True)
        paths.set_split_kv_policy(None)
        paths.set_decode_attention_override()
        set_switches("")

    @staticmethod
    def _set(spec: str) -> None:
        from onecard.kernels import paths

        paths.set_split_kv_policy(*parse_policy(spec))
        base = spec.split("+")[0]
        paths.set_decode_attention_override(**SWEEP_KNOBS.get(base.partition(":")[2], {})
                                            if base.startswith("sweep:") else {})
        set_switches(spec)

    def use(self, spec: str) -> None:
        self._set(spec)                                                 # eager launches decide at launch time
        if spec in self.graphs:
            self.core.runner.graphs = self.graphs[spec]

    def segments(self, spec: str, bs: int, ctx: int) -> dict | None:
        """The segments of the graph's attention launch for ``bs`` sequences, and those a ``ctx`` context fills."""
        runner = self.core.runner
        if spec not in self.graphs:
            return None
        from onecard.kernels import paths

        g = self.graphs[spec]
        gbs = next(b for b in g.batch_sizes if b >= bs)
        dev = runner.device
        cc, sms = paths.capability(dev), paths.device_props(dev.index or 0)[1]
        hkv = int(self.core.config.model.hf_config.get("num_key_value_heads", 4))
        self._set(spec)
        try:
            bound = g.bound(1)                                             # the decode graph's metadata bound
            segs, min_tiles = paths.split_kv(gbs, True, bound, hkv, sms, cc)
        finally:
            paths.set_split_kv_policy(None)
            paths.set_decode_attention_override()
            set_switches("")
        tiles = -(-ctx // paths.attention_tiles(cc, 16)[0])
        per = max(-(-tiles // segs), min_tiles)
        return {"graph_batch": gbs, "graph_bound": bound, "segments": segs, "filled": -(-tiles // per), "tiles_per_segment": per,
                "programs": gbs * hkv * segs, "sms": sms}


def scenario(core, pol: Policies, bs: int, ctx: int, new: int, vocab: int, bw: float | None, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (ctx,), generator=g).tolist() for _ in range(bs)]
    t0 = time.perf_counter()
    run(core, prompts, 2)                                                 # prefill once: the prefix cache keeps it
    prefill_s = time.perf_counter() - t0
    runs: dict[str, list[float]] = {s: [] for s in pol.specs}
    tokens: dict[str, list[list[int]]] = {s: [] for s in pol.specs}
    for rep in range(DECODE_REPEATS):                                     # alternate, the order flipped each time
        for spec in (pol.specs if rep % 2 == 0 else pol.specs[::-1]):
            pol.use(spec)
            runs[spec].append(tpot(run(core, prompts, new, tokens[spec] if rep == 0 else None)))
    res = {"batch": bs, "context": ctx, "new_tokens": new, "first_prefill_s": prefill_s,
           "kv_gb_per_step": bs * ctx * KV_BYTES_PER_TOKEN / 1e9, "policies": {}}
    b = step_bytes(bs, ctx + new // 2) if bw is not None else None       # the context grows during the run
    if b is not None:
        res.update(bytes_per_step_gb=b / 1e9, floor_ms=b / bw * 1e3, floor_tok_s=bs * bw / b)
    for spec, r in runs.items():
        med = statistics.median(r)
        row = {"tpot_ms": med * 1e3, "tok_s": bs / med, "tok_s_min": bs / max(r), "tok_s_max": bs / min(r),
               "tpot_ms_runs": [x * 1e3 for x in r], "split": pol.segments(spec, bs, ctx + new // 2),
               # greedy tokens of the first repeat equal to the first policy's (fp32 atomics may differ in order)
               "tokens_equal_first_policy": tokens[spec] == tokens[pol.specs[0]],
               "tokens": tokens[spec]}                                    # for A/Bs across processes (run_h200 ab)
        if b is not None:
            row["floor_fraction"] = (b / bw) / med
        res["policies"][spec] = row
    main_spec = main_policy(pol.specs)
    res.update({k: res["policies"][main_spec][k] for k in ("tpot_ms", "tok_s", "tok_s_min", "tok_s_max")})
    if "floor_fraction" in res["policies"][main_spec]:
        res["floor_fraction"] = res["policies"][main_spec]["floor_fraction"]
    if "legacy" in runs and main_spec != "legacy":
        res["speedup_vs_legacy"] = res["policies"][main_spec]["tok_s"] / res["policies"]["legacy"]["tok_s"]
    return res


def main(argv: list[str]) -> dict:
    cpu = "--cpu" in argv
    specs = ["legacy", "fill"]
    if "--policies" in argv:
        i = argv.index("--policies")
        specs = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
    if "--sweep" in argv:
        i = argv.index("--sweep")
        specs += [sp for sp in sweep_knobs(argv[i + 1]) if sp not in specs]
        argv = argv[:i] + argv[i + 2:]
    only = None
    if "--scenarios" in argv:                                             # e.g. 1x512,1x32768,16x512
        i = argv.index("--scenarios")
        only = {tuple(int(v) for v in sc.split("x")) for sc in argv[i + 1].split(",")}
        argv = argv[:i] + argv[i + 2:]
    for spec in specs:
        parse_policy(spec)
    model_dir, out = [a for a in argv if a != "--cpu"][:2]
    scen = CPU_SCENARIOS if cpu else SCENARIOS
    if only is not None:
        scen = tuple(sc for sc in scen if sc in only)
        if not scen:
            raise SystemExit(f"--scenarios: none of {sorted(only)} is one of {CPU_SCENARIOS if cpu else SCENARIOS}")
    new = 8 if cpu else NEW_TOKENS
    t0 = time.perf_counter()
    core = engine(model_dir, max(c for _, c in scen), cpu)
    vocab = int(core.config.model.hf_config.get("vocab_size", V))
    pol = Policies(core, specs)
    res: dict = {"paths": None if cpu else capability_record(), "ready_s": time.perf_counter() - t0,
                 "kv_tokens": core.info.kv_capacity_tokens, "policies": specs,
                 "main_policy": main_policy(specs)}
    bw = None if cpu else copy_bandwidth()
    res["copy_bandwidth_tb_s"] = None if bw is None else bw / 1e12
    rows = []
    for i, (bs, ctx) in enumerate(scen):
        r = scenario(core, pol, bs, ctx, new, vocab, bw, seed=100 + i)
        rows.append(r)
        print(json.dumps(r), flush=True)
    shortest = {b: min(c for bb, c in scen if bb == b) for b, _ in scen}
    base = {(r["batch"], spec): p["tok_s"] for r in rows if r["context"] == shortest[r["batch"]]
            for spec, p in r["policies"].items()}
    for r in rows:
        for spec, p in r["policies"].items():
            p["fraction_of_short_context"] = p["tok_s"] / base[(r["batch"], spec)]
        r["fraction_of_short_context"] = r["policies"][res["main_policy"]]["fraction_of_short_context"]
    res["scenarios"] = rows
    res["wall_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(res, indent=1))
    for r in rows:
        floor = f"floor {r['floor_ms']:.3f} ms" if "floor_ms" in r else ""
        print(f"bs {r['batch']:2d} ctx {r['context']:6d} {floor}")
        for spec, p in r["policies"].items():
            sp = p["split"]
            split = f"{sp['segments']} segs ({sp['filled']} filled x {sp['tiles_per_segment']} tiles)" if sp else ""
            frac = f", {100 * p['floor_fraction']:.0f}% of the floor" if "floor_fraction" in p else ""
            print(f"   {spec:24s} {p['tok_s']:9.1f} tok/s (TPOT {p['tpot_ms']:.3f} ms, {p['tok_s_min']:.1f}-"
                  f"{p['tok_s_max']:.1f}; {100 * p['fraction_of_short_context']:.0f}% of the shortest context"
                  f"{frac}) {split}")
    return res


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
