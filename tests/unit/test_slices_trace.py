"""bench/slices_trace.summarize on synthetic stamps: phases from consecutive clock fields at the clock the
stamps imply, the span from the globaltimer fields, programs per SM."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_summarize_reads_the_phases_the_span_and_the_sms():
    from bench.slices_trace import PHASES, summarize
    from onecard.kernels.fused_moe.slices import TRACE_FIELDS, TRACE_SLOTS

    f = {name: i for i, name in enumerate(TRACE_FIELDS)}
    s = torch.zeros(3, TRACE_SLOTS, dtype=torch.int64)
    for p, (sm, t0) in enumerate([(0, 1000), (0, 1500), (1, 1200)]):   # two programs on SM 0, one on SM 1
        clk = [10, 110] + [110 + 2 * (k + 1) * (p + 1) for k in range(5)]   # 2 GHz: phases 1, 2, ... ns x (p+1)
        s[p, :7] = torch.tensor(clk)
        s[p, f["t_waited_ns"]], s[p, f["sm"]] = t0, sm
        s[p, f["t_end_ns"]], s[p, f["sm_end"]] = t0 + (clk[6] - clk[1]) // 2, sm
    out = summarize([s])
    assert abs(out["ghz"] - 2.0) < 1e-9
    assert out["span_ns"] == float(s[:, f["t_end_ns"]].max() - 1000)
    assert out["phase_median_ns"] == {"wait": 50.0, **{p: 2.0 for p in PHASES[1:]}}
    assert out["phase_max_ns"]["tail"] == 3.0
    assert out["programs_per_sm"] == {1: 1, 2: 1} and out["sms_used"] == 2
    assert out["run_ns_one_per_sm"] == 15.0 and out["run_ns_two_per_sm"] == (5.0 + 10.0) / 2
