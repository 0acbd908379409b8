"""GPU-only: ONECARD_L2_PREFETCH (layers/l2_prefetch.py) on a real card.

* The kernel's walk on device memory reaches every cache line of its rows and no byte outside (touch_or, the
  checks of tests/kernels/test_l2_prefetch.py), and the prefetch (plain and evict_last) writes nothing.
* Greedy tokens with the switch on equal those with it off, eager and with CUDA graphs (the side-stream fork and
  join captured in the decode graphs, next to PDL launches), on the GPTQ MoE fixture (batched decode) and the
  bundled g128 coder one request at a time (the batch-1 fused kernels).
"""
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]


@needs_gpu
def test_kernel_walk_and_prefetch_on_device():
    from onecard.kernels.prefetch import triton as tk
    from onecard.kernels.prefetch.table import prefetch_table
    from tests.kernels.test_l2_prefetch import CHUNK, GUARD, RANGES, _pattern, _want

    dev = torch.full((8192,), GUARD, dtype=torch.uint8, device="cuda")
    for lo, n in RANGES:                       # a bit per cache line of the device addresses
        _pattern(dev, lo, n)
    views = [dev[lo:lo + n] for lo, n in RANGES]
    table = prefetch_table(views, dev.device, chunk=CHUNK)
    got = tk.touch_or(table).tolist()
    assert got == [_want(a, n) for a, n in table.tolist()]
    before, tbefore = dev.clone(), table.clone()
    big = torch.randn(64 << 20, device="cuda")                           # a few rows of 256 KB chunks
    bt = prefetch_table([big], big.device)
    for evict_last in (False, True):
        tk.l2_prefetch(table, evict_last)
        tk.l2_prefetch(bt, evict_last)
    torch.cuda.synchronize()
    assert torch.equal(dev, before) and torch.equal(table, tbefore)


def _greedy(monkeypatch, path: Path, mode: str, eager: bool, serial: bool) -> list[list[int]]:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_checks

    monkeypatch.setenv("ONECARD_L2_PREFETCH", mode)
    return gpu_checks.greedy(path, "triton", "float16", eager, serial=serial)


@needs_gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_same_tokens_with_prefetch(monkeypatch, tiny_moe_gptq_dir, eager):
    from onecard.layers.l2_prefetch import L2Prefetcher

    built: list[L2Prefetcher] = []
    orig = L2Prefetcher.__init__

    def record(self, *a, **k):                 # keeps the real constructor; notes what the runner built
        orig(self, *a, **k)
        built.append(self)
    coder = ROOT / "onecard" / "data" / "onecard-tiny-coder"
    for path, serial in ((tiny_moe_gptq_dir, False), (coder, True)):
        off = _greedy(monkeypatch, path, "off", eager, serial)
        for mode in ("on", "evict_last"):
            built.clear()
            with monkeypatch.context() as m:
                m.setattr(L2Prefetcher, "__init__", record)
                on = _greedy(monkeypatch, path, mode, eager, serial)
            assert len(built) == 1 and built[0].enabled, [p.describe() for p in built]
            assert on == off, (path.name, mode, eager)
