"""GPU facts for start-up checks WITHOUT a CUDA context in the calling process (the API process).

A CUDA context costs ~500 MiB of GPU memory for the life of the process (518 MiB measured beside the engine on
the H100), i.e. KV cache lost. ``query_gpu(env)`` reads the card the engine will use — the first entry of
CUDA_VISIBLE_DEVICES (an index, a ``GPU-...`` UUID or a ``MIG-...`` UUID), else NVML index 0 — through NVML
(nvidia-ml-py): name, compute capability, total and free memory. ``arch_list()`` is the compile-time list of
the installed torch (no context either). Where NVML cannot answer (no libnvidia-ml, an old driver), the same
facts come from a throwaway child process that asks torch, so the context dies with it. Raises
``GpuQueryError`` naming what failed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

from onecard.env import Env


class GpuQueryError(RuntimeError):
    pass


@dataclass(slots=True, frozen=True)
class GpuInfo:
    name: str
    cc: tuple[int, int]
    total_memory: int      # bytes
    free_memory: int       # bytes
    source: str            # "nvml" | "torch subprocess"


def visible_device(cuda_visible_devices: str | None) -> int | str:
    """The NVML selector of the process's CUDA device 0: an index into all GPUs, or a UUID string."""
    if cuda_visible_devices is None or not cuda_visible_devices.strip():
        return 0
    first = cuda_visible_devices.split(",")[0].strip()
    if first.isdigit():
        return int(first)
    if first.startswith(("GPU-", "MIG-")):
        return first
    raise GpuQueryError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: cannot tell which GPU is device 0 "
                        "(expected an index or a GPU-/MIG- UUID)")


def _nvml(selector: int | str) -> GpuInfo:
    import pynvml

    pynvml.nvmlInit()
    try:
        if isinstance(selector, int):
            handle = pynvml.nvmlDeviceGetHandleByIndex(selector)
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(selector)
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuInfo(name.decode() if isinstance(name, bytes) else str(name), (int(major), int(minor)),
                       int(mem.total), int(mem.free), "nvml")
    finally:
        pynvml.nvmlShutdown()


_CHILD = """
import json, torch
from onecard.kernels import paths
cc = paths.real_capability(0)
free, total = torch.cuda.mem_get_info(0)
print(json.dumps({"name": torch.cuda.get_device_name(0), "cc": [cc // 10, cc % 10], "total_memory": total,
                  "free_memory": free}))
"""


def _torch_child(timeout: float = 120.0) -> GpuInfo:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout,
                         check=False)
    if out.returncode != 0:
        raise GpuQueryError(f"CUDA initialisation failed: {out.stderr.strip().splitlines()[-1:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return GpuInfo(d["name"], (int(d["cc"][0]), int(d["cc"][1])), int(d["total_memory"]), int(d["free_memory"]),
                   "torch subprocess")


def query_gpu(env: Env | None = None) -> GpuInfo:
    env = env or Env.read()
    selector = visible_device(env.cuda_visible_devices)
    try:
        return _nvml(selector)
    except ImportError:
        nvml_error = "nvidia-ml-py is not installed"
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError_*: no library, driver too old, not supported
        nvml_error = f"{type(e).__name__}: {e}"
    try:
        return _torch_child()
    except (GpuQueryError, subprocess.SubprocessError, ValueError, KeyError) as e:
        raise GpuQueryError(f"cannot read the GPU: NVML failed ({nvml_error}) and so did torch in a child "
                            f"process ({e})") from None


def arch_list() -> list[str]:
    """The sm_XX / compute_XX targets the installed torch was built for (a compile-time fact: no context)."""
    import torch

    return list(torch.cuda.get_arch_list())


def as_dict(info: GpuInfo) -> dict:
    return asdict(info)
