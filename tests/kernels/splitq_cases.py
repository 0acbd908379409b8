"""Split-KV of small-q launches (speculative verify steps; paths switch "small_q_split") under TRITON_INTERPRET=1,
for test_split_small_q.py through interpret_cases.py's worker (cases named ``splitq<i>-<variant>``), and the
(b, q) padded verify layout both this and interpret_cases' ``verifyattn`` cases build.

Each case turns the switch on, gives the launch a CUDA-graph-like bound and an H100's 132 SMs (the "fill"
policy's own segment count for B x KV heads x q-blocks programs), checks that the launch is split with the
row-wise reduce, and returns the relative error of the real rows against the float32 reference on the same cache
(fp8: the same bytes).
"""
from __future__ import annotations

import math

F32, F16 = "fp32", "fp16"
# (contexts incl. the query rows, query rows, Hq, Hkv, block size, padded (b, q) or None, bound). Hq / Hkv = 8 as
# served: BLOCK_Q 2 for q <= 2, else 8 (q = 9: two q-blocks, the second holding one row). Bound 4096: 64 tiles of
# 64 keys, 2-tile segments (many past a short context's end); bound 1024: 1-tile segments, so a q-block whose rows
# straddle a tile edge (context 73 = 64 + 9 rows) leaves its first rows a segment with no visible key (m = -1e30,
# l = 0 in the merge) and one whose first q-block ends at a tile edge (65 = 56 + 9: 1 tile for rows 0..7, 2 for
# row 8). The split's workspaces are poisoned (NaN): a partial the reduce reads but no program wrote shows.
SPLITQ = [([600, 130, 70], [5, 5, 5], 16, 2, 16, None, 4096),              # uniform q
          ([1, 9, 200, 700, 73, 71], [1, 9, 3, 7, 2, 9], 16, 2, 16, None, 4096),   # ragged q 1..9
          ([73, 130, 65, 9], [9, 4, 9, 9], 8, 1, 8, None, 1024),         # 1-tile segments, straddling rows
          ([9, 40, 700], [3, 1, 5], 8, 1, 16, (4, 9), 4096),             # the padded verify layout, q = 9
          ([30, 500], [2, 1], 16, 2, 4, (2, 2), 4096)]                   # ... q = 2 (BLOCK_Q 2)
SPLITQ_CASES = ([f"splitq{i}-{dt}" for i in range(len(SPLITQ)) for dt in (F32, F16)]
                + [f"splitq{i}-fp8e5m2" for i in (1, 2, 3)]
                + [f"splitq{i}-sm70-{dt}" for i in (1, 3) for dt in (F16, "fp8e5m2")])


def padded_verify(md, seq_lens: list[int], qlens: list[int], b: int, q: int, block_size: int, max_seq_len: int):
    """The (b, q) layout of the step ``md`` (runner/cuda_graphs.pad_verify) -> (padded metadata, rows [T]: the
    padded row of each real row). Padded sequences (past the real ones) read block 0."""
    import numpy as np
    import torch

    from onecard.kernels.attention.metadata import AttentionMetadata
    from onecard.runner.cuda_graphs import pad_verify

    cu = md.query_start_loc.numpy()
    pos = np.concatenate([np.arange(L - n, L) for L, n in zip(seq_lens, qlens)])
    p = pad_verify(cu, np.zeros(cu[-1], dtype=np.int64), pos, md.slot_mapping.numpy(), md.seq_lens.numpy(), b, q,
                   max(seq_lens) + q)
    n = len(seq_lens)
    cols = max(md.block_table.shape[1], -(-int(p.seq_lens.max()) // block_size))
    table = torch.zeros(b, cols, dtype=torch.int32)                       # padded sequences: block 0
    table[:n, :md.block_table.shape[1]] = md.block_table
    padded = AttentionMetadata(
        slot_mapping=torch.from_numpy(p.slot_mapping), query_start_loc=torch.arange(b + 1, dtype=torch.int32) * q,
        seq_lens=torch.from_numpy(p.seq_lens), block_table=table, max_query_len=q, max_seq_len=max_seq_len)
    return padded, torch.from_numpy(p.rows)


def splitq_case(name: str, seed: int) -> float:
    import torch
    from kernels_testlib import make_paged_batch, rel_err

    from onecard.kernels import paths
    from onecard.kernels.attention import fp8, ref
    from onecard.kernels.attention import triton as tk

    kind, *rest = name.split("-")
    seq_lens, qlens, hq, hkv, bs, pad, bound = SPLITQ[int(kind[6:])]
    dt = torch.float32 if rest[-1] == F32 else torch.float16
    d = 32
    kc, vc, md, _, _ = make_paged_batch(seq_lens, qlens, hkv, d, bs, dtype=dt, seed=seed)
    if rest[-1] == "fp8e5m2":
        kc, vc = fp8.quantize(kc, fp8.E5M2, 1.0), fp8.quantize(vc, fp8.E5M2, 1.0)
    q_real = torch.randn(sum(qlens), hq, d).to(dt)
    if pad is None:
        launch_md, rows, q_in = md, torch.arange(sum(qlens)), q_real
        md.max_seq_len = bound
    else:
        launch_md, rows = padded_verify(md, seq_lens, qlens, *pad, bs, bound)
        q_in = torch.randn(pad[0] * pad[1], hq, d).to(dt)                 # pad rows: anything
        q_in[rows] = q_real
    s = 1 / math.sqrt(d)
    sms = tk.num_sms
    paths.set_switch("small_q_split", True)
    tk.num_sms = lambda device: 132                                        # an H100's count (interpreter: 4)
    if "sm70" in rest:
        paths.set_emulated_capability(70)                                  # sm70's tiles
    empty = torch.empty

    def poisoned(*a, **k):                                                 # part / ml: NaN until written
        t = empty(*a, **k)
        return t.fill_(math.nan) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        plan = tk.launch_plan(launch_md, hq, hkv, q_in.device)
        assert plan.segments > 1 and plan.row_reduce, f"not a split small-q launch: {plan}"
        out = tk.paged_attention(q_in, kc, vc, launch_md, s)[rows]
    finally:
        torch.empty = empty
        tk.num_sms = sms
        paths.set_switch("small_q_split", None)
        paths.set_emulated_capability(None, clear=True)
    want = ref.paged_attention(q_real.float(), kc if rest[-1] == "fp8e5m2" else kc.float(),
                               vc if rest[-1] == "fp8e5m2" else vc.float(), md, s)
    return rel_err(out, want)
