"""Start-up precompile: dry forwards over every shape class the engine launches, then one parallel compile.

Contract: ``precompile(runner) -> dict | None`` runs before the runner's first real kernel launch (before
``determine_num_blocks``). Inside ``kernels.precompile.record()`` it runs the model's forward (no kernel
executes; one layer of each distinct kind, see representative_layers) on: the memory profile's batch, every
CUDA-graph decode batch at each of its context bounds, every verify graph's shape (with --speculative-config: b sequences x q query
rows, logits at every row), eager decode batches of every size up to max_num_seqs with short and long contexts,
prefill chunks on both sides of every boundary of the kernel-path table (kernels/paths.token_boundaries:
decode-sized, the sorted MoE GEMMs, cuBLAS, the grouped prefill MoE) and at the profile's token budget and mixed decode + prefill steps; then it compiles what was recorded, on all CPUs,
into Triton's on-disk cache. Returns the summary (None where it does not apply, see ``applies``). A failure
here is logged and start-up goes on: the JIT compiles at first launch as before.

The compile workers take seconds to boot (torch + Triton imports): ``start_workers`` starts them before the
runner loads the weights, when precompile will apply, and the runner keeps them as ``runner.compile_pool``;
``precompile`` compiles on them and closes them in every case (also when it is skipped or fails).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from onecard.kernels import dispatch, paths
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.runner.cuda_graphs import graph_bound
from onecard.runner.input_batch import leading_decodes

logger = logging.getLogger(__name__)


def batch(q_lens: list[int], ctx_lens: list[int], block_size: int, device: torch.device,
          max_seq_len: int | None = None, table_width: int | None = None):
    """-> (input_ids [T], positions [T], AttentionMetadata) for sequences with ``ctx_lens`` cached tokens and
    ``q_lens`` new ones (decodes first, as the scheduler orders them). Block ids are arbitrary: no kernel runs."""
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    width = max(table_width or 0, max(blocks))
    table = np.zeros((len(q_lens), width), dtype=np.int32)
    pos = np.concatenate([np.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)]).astype(np.int64)
    slots = pos % block_size                                             # block 0, any slot
    cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])

    def t(a):
        return torch.from_numpy(a).to(device)

    md = AttentionMetadata(
        slot_mapping=t(slots), query_start_loc=t(cu), seq_lens=t(np.asarray(seq_lens, dtype=np.int32)),
        block_table=t(table), max_query_len=max(q_lens), max_seq_len=max_seq_len or max(seq_lens),
        num_decode_tokens=leading_decodes(q_lens), host_query_start_loc=cu,
        host_seq_lens=np.asarray(seq_lens, dtype=np.int32))
    return torch.zeros(int(cu[-1]), dtype=torch.long, device=device), t(pos), md


def dry_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[tuple[list, list, bool]]:
    """(q_lens, ctx_lens, long) per dry forward; long = metadata max_seq_len = max_model_len (as the graphs)."""
    shapes: list[tuple[list, list, bool]] = []
    ctx = min(64, max_model_len - 1)
    for b in range(1, max_num_seqs + 1):                                 # eager decode, every batch size
        shapes.append(([1] * b, [ctx] * b, False))
        shapes.append(([1] * b, [ctx] * b, True))                       # long contexts: split-KV attention
    budget = max(2, min(max_num_batched_tokens, max_model_len))
    # both sides of every boundary of the kernel-path table (each MoE / GEMM path of a prefill chunk, on every
    # capability), and the largest chunk
    sides = sorted({n for b in paths.token_boundaries() for n in (b - 1, b)} | {budget - 1})
    for n in sides:
        if 2 <= n <= budget:
            shapes.append(([n], [0], False))
            shapes.append(([n], [min(100, max_model_len - n)] if max_model_len - n > 0 else [0], False))
    if max_num_seqs >= 2:                                                # mixed steps: decodes + a chunk
        if budget >= 4:
            shapes.append(([1, 1, min(100, budget - 2)], [ctx, ctx, 0], False))
        n = max(2, budget - (max_num_seqs - 1))
        shapes.append(([1] * (max_num_seqs - 1) + [n], [ctx] * (max_num_seqs - 1) + [0], False))
    return shapes


def _describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype), v.stride())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return tuple((f.name, _describe(getattr(v, f.name))) for f in dataclasses.fields(v))
    if isinstance(v, (bool, int, float, str, type(None))):
        return v
    return type(v).__name__


def representative_layers(layers: nn.ModuleList) -> list[int]:
    """Index of the first layer of each distinct kind: same module types, attribute values, tensor shapes,
    dtypes and strides (hence the same kernel launches). Qwen3-MoE: one of 48."""
    first: dict[tuple, int] = {}
    for i, layer in enumerate(layers):
        key = tuple((name, type(m).__name__,
                     tuple(sorted((k, _describe(v)) for k, v in vars(m).items() if not k.startswith("_"))))
                    for name, m in layer.named_modules())
        first.setdefault(key, i)
    return sorted(first.values())


@torch.inference_mode()
def dry_run(runner) -> None:
    """Every forward the precompile records, through one layer of each kind, twice (identical layers launch
    identical kernels given the same inputs, and each skipped launch saves Triton's launch-path Python, ~0.3 ms:
    48 layers x ~50 shapes was 12 s), over the runner's KV cache. Inside ``record()`` no kernel runs, so two blocks do; elsewhere these are
    real forwards (the tests run them on the CPU) and need the memory profile's blocks."""
    sched = runner.config.scheduler
    model = runner.model
    reps = representative_layers(model.layers)
    tokens = sched.max_num_batched_tokens
    runner.profile_forward(tokens, max(1, min(sched.max_num_seqs, tokens)), reps)   # the memory profile
    # each kind twice: a layer's launches also depend on what comes in (the first layer gets the embedding and no
    # residual; later ones a residual and the previous layer's output, e.g. the batch-1 MoE's fp32 sums)
    layer_ids = reps + reps
    for bs in runner.graph_batch_sizes():                                 # the decode graphs
        bound = graph_bound(sched.max_model_len, 1)
        ids, pos, md = batch([1] * bs, [1] * bs, runner.block_size, runner.device, max_seq_len=bound,
                             table_width=-(-bound // runner.block_size))
        model(ids, pos, runner.kv_caches, md, layer_ids)
    for bs, q in runner.verify_graph_shapes():                            # the verify graphs (speculation)
        bound = graph_bound(sched.max_model_len, q)
        ids, pos, md = batch([q] * bs, [1] * bs, runner.block_size, runner.device, max_seq_len=bound,
                             table_width=-(-bound // runner.block_size))
        model.compute_logits(model(ids, pos, runner.kv_caches, md, layer_ids))
    for q, c, long in dry_shapes(sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len):
        ids, pos, md = batch(q, c, runner.block_size, runner.device, max_seq_len=sched.max_model_len if long else None)
        model.compute_logits(model(ids, pos, runner.kv_caches, md, layer_ids)[-1:])


def applies(device: torch.device, env, log: bool = True) -> bool:
    """Will the precompile run? A CUDA device on the Triton backend, ONECARD_PRECOMPILE not 0 (``env``:
    config.Env), and no onecard kernel compiled yet in this process (record() would refuse). ``log``: say so
    when a compiled kernel is the reason (precompile() does; start_workers() asks the same question first)."""
    if device.type != "cuda" or dispatch.backend_for(device) != "triton" or not env.precompile:
        return False
    from onecard.kernels import precompile as pc

    if pc.any_compiled():
        if log:
            logger.info("precompile skipped: a kernel was compiled before start-up")
        return False
    return True


def start_workers(device: torch.device, env):
    """-> a started kernels.precompile.WorkerPool (min(MAX_WORKERS, CPUs) workers) where the precompile
    applies, else None. The caller closes it: precompile() does."""
    if not applies(device, env, log=False):
        return None
    from onecard.kernels import precompile as pc

    try:
        return pc.WorkerPool()
    except Exception:  # compile_all starts its own workers later (or logs why it cannot)
        logger.exception("could not start the precompile workers early")
        return None


def precompile(runner) -> dict | None:
    pool, runner.compile_pool = getattr(runner, "compile_pool", None), None
    try:
        return _precompile(runner, pool) if applies(runner.device, runner.config.env) else None
    finally:
        if pool is not None:
            pool.close()


@torch.inference_mode()
def _precompile(runner, pool) -> dict | None:
    from onecard.kernels import precompile as pc

    t0 = time.perf_counter()
    try:
        runner.initialize_kv_cache(2, log=False)                          # shapes/strides only: nothing runs
        with pc.record() as rec:
            if rec is None:
                logger.info("precompile skipped: a kernel was compiled before start-up")
                return None
            dry_run(runner)
        torch.cuda.synchronize()
        dry = time.perf_counter() - t0
        summary = pc.compile_all(list(rec.specs.values()), pc.current_target(), pool=pool)
    except Exception:  # start-up goes on; the JIT compiles at first launch
        logger.exception("precompile failed; kernels compile at their first launch")
        return None
    finally:
        runner.kv_caches = []
    summary.update(dry_seconds=dry, launches=rec.launches, total_seconds=time.perf_counter() - t0)
    logger.info("precompiled %d of %d kernel variants in %.1f s (%d workers; dry forwards %.1f s)",
                summary["compiled"], summary["kernels"], summary["total_seconds"], summary["workers"], dry)
    return summary


__all__ = ["applies", "batch", "dry_run", "dry_shapes", "precompile", "representative_layers", "start_workers"]
