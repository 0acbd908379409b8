"""The next layer's KV read into L2 while a batch-1 decode step's MoE runs (kernels/paths.batch1_kv_prefetch).

Contract: ``KvPrefetch.for_step(model, input_ids, kv_caches, md) -> KvPrefetch | None`` (None: this step does not
prefetch: switch off, not one decode token, not CUDA, not the Triton backend, or an fp8 cache); then, for the
forward's layers in order, ``after_attention(j)`` is called by layer j once its attention block has run (it forks
a side stream from the main one and launches ``dispatch.kv_touch`` over layer j + 1's cache there), and ``join()``
once after the last layer (the main stream waits for the side stream: a CUDA-graph capture must end joined, and
nothing else waits on it, so the main chain gains no dependency). The side stream and the sums' buffer are the
model's (``Qwen3ForCausalLM.kv_prefetch_stream`` and ``kv_prefetch_sums``, one buffer per budget), made on the
first step that prefetches (outside a capture: the graph runner warms up every graph eagerly before capturing it)
and never freed: a captured graph writes the buffer it was captured with, and another budget (a benchmark's
policy) gets a buffer of its own. The reads change
no value: a step computes the same with or without them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from onecard.kernels import dispatch as ops
from onecard.kernels import paths
from onecard.kernels.attention.metadata import AttentionMetadata


class KvPrefetch:
    def __init__(self, stream: torch.cuda.Stream, sums: torch.Tensor, caches: Sequence[tuple[torch.Tensor, ...]],
                 md: AttentionMetadata, positions: int):
        self.stream, self.sums, self.caches, self.md, self.positions = stream, sums, caches, md, positions
        self.forked = False

    @staticmethod
    def for_step(model, input_ids: torch.Tensor, caches: Sequence[tuple[torch.Tensor, ...]],
                 md: AttentionMetadata) -> KvPrefetch | None:
        """``caches``: the forward's layers' caches, in the order it runs them."""
        if not (paths.batch1_kv_prefetch(input_ids.shape[0]) and md.num_decode_tokens == 1 and input_ids.is_cuda
                and len(caches) > 1 and ops.backend_for(input_ids.device) == "triton"):
            return None
        k = caches[0][0]
        if k.dtype != model.dtype:                                        # fp8 caches: the switch does not apply
            return None
        positions = paths.kv_prefetch_positions(k.shape[2], k.shape[3], k.element_size())   # whole chunks
        if model.kv_prefetch_stream is None:
            model.kv_prefetch_stream = torch.cuda.Stream(k.device)
        if positions not in model.kv_prefetch_sums:
            model.kv_prefetch_sums[positions] = torch.empty(positions // paths.KV_PREFETCH_CHUNK, dtype=torch.float32,
                                                            device=k.device)
        return KvPrefetch(model.kv_prefetch_stream, model.kv_prefetch_sums[positions], caches, md, positions)

    def after_attention(self, j: int) -> None:
        """Layer j's attention block has run: read layer j + 1's KV on the side stream (nothing after the last)."""
        if j + 1 >= len(self.caches):
            return
        main = torch.cuda.current_stream(self.sums.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            k_cache, v_cache = self.caches[j + 1][:2]
            ops.kv_touch(k_cache, v_cache, self.md, self.positions, self.sums)
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream(self.sums.device).wait_stream(self.stream)
