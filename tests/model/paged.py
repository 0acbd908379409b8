"""A hand-built paged KV cache and AttentionMetadata for driving our model in tests (no scheduler/runner).

Contract: ``PagedCache(model_cfg, num_blocks, block_size, dtype)`` holds per-layer (k_cache, v_cache)
[num_blocks, block_size, kv_heads, head_dim] and a block allocator; ``seq = cache.new_seq()`` gives a
sequence id; ``cache.step(model, [(seq, new_token_ids), ...])`` appends the new tokens of each sequence
(one flattened forward: prefill chunks, decode tokens, any mix) and returns the hidden state of every new
token [T, H] plus per-sequence slices. Blocks are handed out in a scrambled order so that block tables are
not the identity (a bug that ignores the table must fail).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from onecard.kernels.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Seq:
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class PagedCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int = 64,
                 block_size: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0):
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(num_layers)]
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.seqs: list[_Seq] = []

    @classmethod
    def for_model(cls, model, **kw) -> PagedCache:
        return cls(len(model.layers), model.num_kv_heads, model.head_dim, **kw)

    def new_seq(self) -> int:
        self.seqs.append(_Seq())
        return len(self.seqs) - 1

    def _slot(self, s: _Seq, pos: int) -> int:
        while pos // self.block_size >= len(s.blocks):
            s.blocks.append(self.free.pop())
        return s.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def metadata(self, batch: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [T], positions [T], metadata) for appending ``batch``; updates the sequences."""
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for sid, new in batch:
            s = self.seqs[sid]
            start = len(s.tokens)
            for j, tok in enumerate(new):
                ids.append(tok)
                pos.append(start + j)
                slots.append(self._slot(s, start + j))
            s.tokens.extend(new)
            qsl.append(qsl[-1] + len(new))
            lens.append(len(s.tokens))
        max_blocks = max(len(self.seqs[sid].blocks) for sid, _ in batch)
        table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for i, (sid, _) in enumerate(batch):
            b = self.seqs[sid].blocks
            table[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        qlens = [len(n) for _, n in batch]
        num_decode = 0
        for q in qlens:
            if q != 1:
                break
            num_decode += 1
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
            max_query_len=max(qlens), max_seq_len=max(lens), num_decode_tokens=num_decode)
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), md

    @torch.no_grad()
    def step(self, model, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one flattened forward over ``batch``; returns each sequence's hidden rows [q_i, H]."""
        ids, pos, md = self.metadata(batch)
        hidden = model.forward(ids, pos, self.kv_caches, md)                    # [T, H]
        qsl = md.query_start_loc.tolist()
        return [hidden[qsl[i]:qsl[i + 1]] for i in range(len(batch))]
