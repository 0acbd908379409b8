"""Attention metadata for one forward over a flattened variable-length batch.

Contract: built by the model runner each step and passed down the forward call (never global). It lives
beside the attention kernels that read it, so that models, layers and kernels import nothing from the runner.
A batch is B sequences whose new tokens are concatenated: sequence i owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; its context (cached prefix + these new tokens) is
``seq_lens[i]`` tokens long, so its new tokens sit at positions ``seq_lens[i] - query_len_i ...``.
Token t's K/V go to flat slot ``slot_mapping[t] = block_id * block_size + offset`` (-1 = do not store).
Causal rule: query row at position p attends to keys at positions <= p of its own sequence.
Host copies: a builder that has query_start_loc and seq_lens on the host (the runner's eager steps, the
precompile's and the memory profile's forwards) passes them too; CUDA graphs' metadata has none (its lengths
change on the device between replays). A launch that treats sequences differently by length reads them
(attention/sdpa.py below sm80) without a device sync; ``select`` cuts a batch down to some of its sequences.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64
    query_start_loc: torch.Tensor     # [B+1] int32
    seq_lens: torch.Tensor            # [B] int32
    block_table: torch.Tensor         # [B, max_blocks_per_seq] int32 (unused entries: any valid id, e.g. 0)
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0        # leading sequences with query_len 1 (decode); kernels may specialise
    host_query_start_loc: np.ndarray | None = None   # [B+1] int32, query_start_loc on the host (or None)
    host_seq_lens: np.ndarray | None = None          # [B] int32, seq_lens on the host (or None)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def has_host_lens(self) -> bool:
        return self.host_query_start_loc is not None and self.host_seq_lens is not None


def select(md: AttentionMetadata, seqs: Sequence[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """-> (the metadata of sequences ``seqs`` of md alone, in that order; their query rows in md's flattening
    [T'] int64, on md's device). Needs the host copies; a decode among ``seqs`` must be one of md's leading
    decodes and they must all come first, in order (they stay the new batch's leading decodes). The block table
    and lengths are gathered on the device (no sync); the new query_start_loc goes up with the rows."""
    assert md.has_host_lens, "select needs the host copies of query_start_loc and seq_lens"
    qsl, lens = md.host_query_start_loc, md.host_seq_lens
    idx = np.asarray(seqs, dtype=np.int64)
    q_lens = (qsl[idx + 1] - qsl[idx]).astype(np.int32)
    rows = np.concatenate([np.arange(qsl[i], qsl[i + 1], dtype=np.int64) for i in idx])
    decodes = int(np.sum(idx < md.num_decode_tokens))
    assert np.array_equal(idx[:decodes], np.arange(decodes)), "decodes must lead, in order"
    new_qsl = np.zeros(len(idx) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=new_qsl[1:])
    dev = md.seq_lens.device

    def up(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(dev, non_blocking=True)

    rows_t, idx_t = up(rows), up(idx)
    sub = AttentionMetadata(
        slot_mapping=md.slot_mapping.index_select(0, rows_t), query_start_loc=up(new_qsl),
        seq_lens=md.seq_lens.index_select(0, idx_t), block_table=md.block_table.index_select(0, idx_t),
        max_query_len=int(q_lens.max()), max_seq_len=int(lens[idx].max()), num_decode_tokens=decodes,
        host_query_start_loc=new_qsl, host_seq_lens=lens[idx].astype(np.int32))
    return sub, rows_t
