"""Stream the next layer's dense weights into L2 while this layer's MLP (the MoE) runs (ONECARD_L2_PREFETCH).

Why: at batch 1 each MoE stage reads ~19 MB at ~1 TB/s, a quarter of the HBM bandwidth, and then the next
layer's dense GEMVs (qkv_proj, o_proj: ~10 MB of packed int4 with the router) wait on their weight bytes. Those
bytes are known in advance, so a side stream prefetches them into L2 during the MoE and the GEMVs read L2.

Contract: ``L2Prefetcher(mode, device, layer_tensors)`` (mode: env.L2_PREFETCH_MODES; ``layer_tensors[i]``:
layer i's tensors in the order the layer reads them) builds one prefetch table per layer (kernels/prefetch/
table.py) and is ``enabled`` where the mode is on and kernels/paths.l2_prefetch_fits says the L2 holds a layer
(sm80+, at most a third of it; off below: Volta's 6 MB). Per forward: ``active(num_tokens)`` (paths.
use_l2_prefetch: decode-sized steps), ``start(i)`` at the start of a layer's MLP launches the prefetch of layer
i's table on the side stream, forked from the current stream (an event: the side stream waits for what the
current stream has queued so far, nothing waits for the side stream), and ``join()`` at the end of the forward
makes the current stream wait for the side stream, once. The join is the forward's last launch, so it never sits
in front of a PDL launch (kernels/triton_common.py: a PDL kernel's programs start while the previous launch in
the stream runs; an event wait in between would cut that overlap). Inside a CUDA-graph capture the fork and the
join are graph edges (a parallel branch of prefetch nodes), so the captured decode graphs carry the prefetches.
Off a GPU there is no stream: ``start`` calls the op in place (the reference: a no-op; the interpreter walks the
same addresses with loads), so the CPU tests run this code path.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from onecard.env import L2_PREFETCH_MODES
from onecard.kernels import dispatch as ops
from onecard.kernels import paths
from onecard.kernels.prefetch.table import prefetch_table, table_bytes

logger = logging.getLogger(__name__)


class L2Prefetcher:
    def __init__(self, mode: str, device: torch.device, layer_tensors: Sequence[Sequence[torch.Tensor]]):
        if mode not in L2_PREFETCH_MODES:
            raise ValueError(f"L2 prefetch mode {mode!r} is not one of {L2_PREFETCH_MODES}")
        self.mode, self.device = mode, device
        self.evict_last = mode == "evict_last"
        self.tables = [prefetch_table(ts, device) for ts in layer_tensors]     # [R_i, 2] each
        self.layer_bytes = max((table_bytes(t) for t in self.tables), default=0)
        gpu = device.type == "cuda"
        self.cc = paths.capability(device)
        self.l2_bytes = paths.l2_cache_bytes(device.index or 0) if gpu else None
        self.enabled = mode != "off" and paths.l2_prefetch_fits(self.cc, self.l2_bytes, self.layer_bytes)
        self.stream = torch.cuda.Stream(device) if (gpu and self.enabled) else None
        self._forked = False

    def describe(self) -> str:
        state = "on" if self.enabled else "off"
        where = f"sm{self.cc}, L2 {self.l2_bytes / 2**20:.0f} MiB" if self.l2_bytes else f"sm{self.cc}"
        return (f"L2 prefetch {state} (mode {self.mode}; {self.layer_bytes / 2**20:.1f} MiB per layer, "
                f"{max((t.shape[0] for t in self.tables), default=0)} programs; {where})")

    def active(self, num_tokens: int) -> bool:
        return self.enabled and paths.use_l2_prefetch(num_tokens)

    def start(self, layer: int) -> None:
        """Prefetch layer ``layer``'s table beside whatever the current stream runs next."""
        table = self.tables[layer]
        if self.stream is None:                       # CPU: the op in place (no-op / interpreter walk)
            ops.l2_prefetch(table, self.evict_last)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ops.l2_prefetch(table, self.evict_last)
        self._forked = True

    def join(self) -> None:
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._forked = False
