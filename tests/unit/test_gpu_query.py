"""onecard.gpu_query: which GPU NVML reads (CUDA_VISIBLE_DEVICES), and that start-up checks on a machine
where neither NVML nor CUDA answers fail with one message naming both, from the API process's code path
(preflight), without touching torch.cuda in this process."""
from __future__ import annotations

import dataclasses

import pytest

from onecard.config import EngineArgs, Env
from onecard.gpu_query import GpuQueryError, query_gpu, visible_device
from onecard.preflight import PreflightError, preflight


@pytest.mark.parametrize("value,want", [(None, 0), ("", 0), ("3", 3), ("2,0", 2), (" 1 , 0", 1),
                                        ("GPU-8a3c-11", "GPU-8a3c-11"), ("MIG-5f2a/1/0", "MIG-5f2a/1/0")])
def test_visible_device(value, want):
    assert visible_device(value) == want


def test_visible_device_refuses_what_it_cannot_map():
    with pytest.raises(GpuQueryError, match="CUDA_VISIBLE_DEVICES='nvidia0'"):
        visible_device("nvidia0")


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="a machine with NVML answers; the GPU script checks that path")
def test_no_gpu_preflight_names_nvml_and_torch_and_leaves_cuda_alone(tiny_moe_gptq_dir):
    import torch

    cfg = EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu").create_config()
    cfg = dataclasses.replace(cfg, device="cuda")
    with pytest.raises(PreflightError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert "NVML failed" in msg and "torch in a child process" in msg and "--device cpu" in msg, msg
    assert not torch.cuda.is_initialized()            # the query ran in a child, not here
    with pytest.raises(GpuQueryError):
        query_gpu(Env.read())
