"""The GPU cards onecard knows by name (memory, compute capability): one table for ``onecard plan`` and the
speculative-decoding cost model. Pure data, no torch.

Contract: ``GPUS`` (canonical name -> ``GpuSpec``); ``find_gpu(name)`` finds a card by any spelling ("v100-32gb",
"H200", torch's "NVIDIA H200", "Tesla V100-SXM2-32GB") or raises ``ConfigError`` naming the known ones.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from onecard.env import ConfigError


@dataclass(slots=True)
class GpuSpec:
    name: str
    memory_gib: float          # total memory as the driver reports it (nvidia-smi MiB / 1024)
    cc: tuple[int, int]


GPUS = {g.name: g for g in (
    GpuSpec("V100-16GB", 16160 / 1024, (7, 0)), GpuSpec("V100-32GB", 32510 / 1024, (7, 0)),
    GpuSpec("T4", 15360 / 1024, (7, 5)), GpuSpec("A10", 23028 / 1024, (8, 6)),
    GpuSpec("A100-40GB", 40960 / 1024, (8, 0)), GpuSpec("A100-80GB", 81920 / 1024, (8, 0)),
    GpuSpec("L4", 23034 / 1024, (8, 9)), GpuSpec("L40S", 46068 / 1024, (8, 9)),
    GpuSpec("H100-80GB", 81559 / 1024, (9, 0)), GpuSpec("H200", 143771 / 1024, (9, 0)),
)}
_ALIASES = {"V100": "V100-32GB", "A100": "A100-80GB", "H100": "H100-80GB", "V10016GB": "V100-16GB",
            "V10032GB": "V100-32GB", "A10040GB": "A100-40GB", "A10080GB": "A100-80GB", "H10080GB": "H100-80GB"}


def find_gpu(name: str) -> GpuSpec:
    """A known card by name, case- and punctuation-insensitive ("v100-32gb", "H200", "NVIDIA H200")."""
    def key(s: str) -> str:
        # torch/nvidia-smi names carry vendor and form factor: "Tesla V100-SXM2-32GB", "NVIDIA H100 80GB HBM3".
        s = re.sub(r"NVIDIA|TESLA|SXM\d?|PCIE|HBM\dE?|NVL", "", s.upper())
        return "".join(c for c in s if c.isalnum())
    k = key(name)
    for g in GPUS.values():
        if key(g.name) == k:
            return g
    for alias, target in _ALIASES.items():
        if key(alias) == k:
            return GPUS[target]
    raise ConfigError(f"--gpu={name} is unknown; known: {', '.join(GPUS)} (or pass --gpu-memory-gib N).")
