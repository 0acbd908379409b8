"""The prefill MoE path (dequantize all experts + PyTorch grouped GEMM over expert-sorted tokens) vs ref, and
its below-sm80 variant (one GEMM per expert).

Runs on the CPU: the dequantization is the Triton kernel under TRITON_INTERPRET=1 (in a subprocess so the
interpreter setting does not leak), the grouped GEMM is PyTorch's own.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "tests/kernels")
    from kernels_testlib import random_gptq
    from onecard.kernels.fused_moe import grouped, ref
    seed = int(torch.randint(0, 10**6, ()).item())
    torch.manual_seed(seed)
    E, H, I, T, k = 8, 64, 32, 37, 2
    for desc_act in (False, True):
        wg, _ = random_gptq(H, I, 32, experts=E, seed=seed + 1, desc_act=desc_act)
        wu, _ = random_gptq(H, I, 32, experts=E, seed=seed + 2, desc_act=desc_act)
        wd, _ = random_gptq(I, H, 32, experts=E, seed=seed + 3, desc_act=desc_act)
        x = torch.randn(T, H) * 0.3
        wf = [torch.randn(E, H, I) * 0.1, torch.randn(E, H, I) * 0.1, torch.randn(E, I, H) * 0.1]
        lg = torch.randn(T, E)
        skew = lg - 100 * (torch.arange(E) >= E // 2)           # experts E/2.. get no rows: empty runs
        for lgs in (lg, skew):
            want = ref.fused_moe(x, lgs, wg, wu, wd, k, True)
            want_f = ref.fused_moe(x, lgs, *wf, k, False)
            for loop in (False, True):      # PyTorch's grouped GEMM / one GEMM per expert (below sm80)
                got = grouped.fused_moe(x, lgs, wg, wu, wd, k, True, per_expert_gemm=loop)
                err = ((got - want).norm() / want.norm()).item()
                print(seed, desc_act, loop, err)
                assert err < 1e-4, (seed, desc_act, loop, err)
                got = grouped.fused_moe(x, lgs, *wf, k, False, per_expert_gemm=loop)
                assert ((got - want_f).norm() / want_f.norm()).item() < 1e-4, (seed, desc_act, loop)
    print("ok")
""")


def test_grouped_moe_matches_ref():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
