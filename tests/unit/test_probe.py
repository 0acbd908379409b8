"""`onecard probe` on this machine: CPU mode without a GPU, exit 0, --json parses."""
from __future__ import annotations

import json
import os

import pytest
import torch

from onecard.hardware import main_probe, probe

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this test is for machines without a GPU")


@no_gpu
def test_probe_cpu_mode():
    r = probe()
    assert r.mode == "cpu" and r.gpus == [] and r.ok and r.failed_step is None
    assert r.torch_version == torch.__version__
    assert "CPU mode" in r.render() and "verdict:" in r.render()
    assert set(r.cpu_backends) == {"attention", "dense_gemm", "moe", "sampling"}
    triton_step = next(s for s in r.steps if s.name == "triton")
    assert "run skipped" in triton_step.detail


@no_gpu
def test_main_probe_exit_code_and_text(capsys):
    assert main_probe(as_json=False) == 0
    assert "no GPU visible: CPU mode" in capsys.readouterr().out


@no_gpu
def test_main_probe_json_parses(capsys):
    assert main_probe(as_json=True) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "cpu" and d["ok"] is True and d["failed_step"] is None
    assert d["torch_version"] == torch.__version__ and d["triton_version"]
    assert isinstance(d["steps"], list) and d["verdict"]


def test_probe_reports_host_memory_for_the_host_tier():
    """Total RAM as the kernel's sysinfo counts it (sysconf), available at most that; the text names the flag."""
    r = probe()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert abs(r.host_memory_total_gib * 2**30 - total) < 2**20
    assert 0 < r.host_memory_available_gib <= r.host_memory_total_gib
    assert "--kv-offloading-size" in r.render()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_on_gpu(capsys):
    r = probe()
    assert r.mode == "cuda" and r.gpus
    g = r.gpus[0]
    major, minor = torch.cuda.get_device_capability(0)
    assert g.compute_capability == f"{major}.{minor}"
    assert abs(g.total_memory_gib - torch.cuda.get_device_properties(0).total_memory / 2**30) < 0.01
    assert any(s.name == "triton" and s.status == "ok" and "ran" in s.detail for s in r.steps)
    assert main_probe(as_json=True) == (0 if r.ok else 1)
    json.loads(capsys.readouterr().out)
