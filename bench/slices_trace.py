"""Where the batch-1 MoE slices' time goes, inside the full model: the slices kernel's TRACE stamps.

Usage (on the GPU, from the repo root): python bench/slices_trace.py MODEL_DIR OUT.json [CONTEXT]
  MODEL_DIR: bench/full_size.py build's checkpoint; SLICES_TRACE_SWITCHES="name=0,..." sets kernels/paths switches
  first, SLICES_TRACE_CONFIG="32,32,1024,8,1" replaces slices.SLICES_CONFIG. One request of CONTEXT (default 512)
  random tokens decodes 24 tokens through the batch-1 CUDA graph, whose 48 slices launches (fused_moe/slices.py,
  TRACE on: this script wraps slices.moe_slices so that each launch gets a stamp buffer) store per program
  %clock64 at each phase boundary and %globaltimer / %smid after the PDL wait and at the end (slices.TRACE_FIELDS). The last replay's
  48 buffers are read. Printed (and in OUT.json): per layer the span from the first program past its wait to the
  last program's end (ns); each phase's median and max over programs (ns, cycles converted at the clock the
  stamps imply); programs per SM, and how long a program takes on SMs holding one vs two.
The stamps themselves add work (a reduction at three boundaries): the span is an upper bound on the untraced
launch's; compare phases with each other, and the span with bench/profile_decode.py's critical path.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("wait", "route", "gate_up", "h", "down0", "tail")   # between consecutive clock fields 0..6


def _traced_launches():
    """Wrap slices.moe_slices: every launch gets a zeroed int64 stamp buffer; -> the list they are appended to."""
    from onecard.kernels import paths
    from onecard.kernels.fused_moe import slices

    bufs: list[torch.Tensor] = []
    orig = slices.moe_slices

    def traced(x, out32, w_gate, w_up, w_down, topk_ids, topk_w, top_k, use_pdl, logits=None, renormalize=True,
               trace=None):
        programs = slices.grid(w_gate, w_down, top_k, paths.capability(x.device))
        buf = torch.zeros(programs, slices.TRACE_SLOTS, dtype=torch.int64, device=x.device)
        bufs.append(buf)
        return orig(x, out32, w_gate, w_up, w_down, topk_ids, topk_w, top_k, use_pdl, logits=logits,
                    renormalize=renormalize, trace=buf)

    slices.moe_slices = traced
    return bufs


def summarize(stamps: list[torch.Tensor]) -> dict:
    """Per-layer figures of the traced launches ([programs, TRACE_SLOTS] each), medians over layers."""
    from onecard.kernels.fused_moe.slices import TRACE_FIELDS

    f = {name: i for i, name in enumerate(TRACE_FIELDS)}
    layers = []
    for s in stamps:
        s = s.double()
        clk = s[:, :7]                                                   # start .. end, cycles
        ns_run = s[:, f["t_end_ns"]] - s[:, f["t_waited_ns"]]
        cyc_run = clk[:, 6] - clk[:, 1]
        ghz = float((cyc_run / ns_run.clamp_min(1)).median())            # the SM clock the stamps imply
        phases = (clk[:, 1:] - clk[:, :-1]) / ghz                        # [P, 6] ns
        per_sm = Counter(int(v) for v in s[:, f["sm"]])
        on_two = torch.tensor([per_sm[int(v)] >= 2 for v in s[:, f["sm"]]])
        run = (clk[:, 6] - clk[:, 1]) / ghz
        layers.append({
            "span_ns": float(s[:, f["t_end_ns"]].max() - s[:, f["t_waited_ns"]].min()),
            "waited_spread_ns": float(s[:, f["t_waited_ns"]].max() - s[:, f["t_waited_ns"]].min()),
            "ghz": ghz,
            "phase_median_ns": {p: float(phases[:, i].median()) for i, p in enumerate(PHASES)},
            "phase_max_ns": {p: float(phases[:, i].max()) for i, p in enumerate(PHASES)},
            "sms_used": len(per_sm), "programs_per_sm": dict(sorted(Counter(per_sm.values()).items())),
            "run_ns_one_per_sm": float(run[~on_two].mean()) if (~on_two).any() else None,
            "run_ns_two_per_sm": float(run[on_two].mean()) if on_two.any() else None,
            "same_sm_moved": int((s[:, f["sm"]] != s[:, f["sm_end"]]).sum()),
        })
    med = lambda key: statistics.median(lay[key] for lay in layers if lay[key] is not None)
    return {
        "layers": len(layers),
        "span_ns": med("span_ns"), "waited_spread_ns": med("waited_spread_ns"), "ghz": med("ghz"),
        "phase_median_ns": {p: statistics.median(lay["phase_median_ns"][p] for lay in layers) for p in PHASES},
        "phase_max_ns": {p: statistics.median(lay["phase_max_ns"][p] for lay in layers) for p in PHASES},
        "run_ns_one_per_sm": med("run_ns_one_per_sm"), "run_ns_two_per_sm": med("run_ns_two_per_sm"),
        "programs_per_sm": layers[-1]["programs_per_sm"], "sms_used": layers[-1]["sms_used"],
        "per_layer": layers,
    }


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    from onecard.kernels import paths
    for item in filter(None, os.environ.get("SLICES_TRACE_SWITCHES", "").split(",")):   # e.g. batch1_slices_route=0
        name, _, on = item.partition("=")
        paths.set_switch(name, on == "1")
    if os.environ.get("SLICES_TRACE_CONFIG"):                             # e.g. the gate/up loop pipelined
        from onecard.kernels.fused_moe import slices
        slices.SLICES_CONFIG = tuple(int(v) for v in os.environ["SLICES_TRACE_CONFIG"].split(","))
    bufs = _traced_launches()
    from bench.full_size import V, _engine, _run

    core, _ = _engine(model_dir)
    g = torch.Generator().manual_seed(1)
    _run(core, [torch.randint(0, V, (context,), generator=g).tolist()], 24)
    torch.cuda.synchronize()
    from onecard.kernels.fused_moe.slices import TRACE_FIELDS
    t_end = TRACE_FIELDS.index("t_end_ns")
    ends = [float(b[:, t_end].max()) for b in bufs]                      # the last replay's are the latest
    last = sorted(range(len(bufs)), key=lambda i: ends[i])[-48:]
    res = {"context": context, "launches_traced": len(bufs), "switches": paths.switches(),
           **summarize([bufs[i].cpu() for i in sorted(last)])}
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"slices trace, bs1 ctx {context}: {res['layers']} layers, median over layers; SM clock {res['ghz']:.2f} GHz")
    print(f"  span (first program past its wait -> last program's end): {res['span_ns'] / 1e3:.2f} µs; "
          f"programs pass the wait over {res['waited_spread_ns'] / 1e3:.2f} µs")
    print("  phase            median µs   max µs")
    for p in PHASES:
        print(f"  {p:14s} {res['phase_median_ns'][p] / 1e3:10.2f} {res['phase_max_ns'][p] / 1e3:8.2f}")
    print(f"  a program's run (wait -> end): {res['run_ns_one_per_sm'] / 1e3:.2f} µs alone on its SM, "
          f"{res['run_ns_two_per_sm'] / 1e3:.2f} µs beside another; SMs used {res['sms_used']}, "
          f"programs per SM {res['programs_per_sm']}")
    print(f"  ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
