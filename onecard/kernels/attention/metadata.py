"""Attention metadata for one forward over a flattened variable-length batch.

Contract: built by the model runner each step and passed down the forward call (never global). It lives
beside the attention kernels that read it, so that models, layers and kernels import nothing from the runner.
A batch is B sequences whose new tokens are concatenated: sequence i owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; its context (cached prefix + these new tokens) is
``seq_lens[i]`` tokens long, so its new tokens sit at positions ``seq_lens[i] - query_len_i ...``.
Token t's K/V go to flat slot ``slot_mapping[t] = block_id * block_size + offset`` (-1 = do not store).
Causal rule: query row at position p attends to keys at positions <= p of its own sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
