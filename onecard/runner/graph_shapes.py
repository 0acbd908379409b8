"""Which step shapes the runner replays from CUDA graphs (pure Python, no torch: the cost model reads it too).

Contract: ``graph_batch_sizes(max_num_seqs)``: the decode graphs' batch sizes (1, 2, 4, 8, 16, 24, 32, ... up to
max_num_seqs, which is always one). ``verify_graph_shapes(batch_sizes, num_speculative_tokens)``: the
speculative verify graphs, (b, q) = b sequences of q query rows each, q = 2 .. 1 + num_speculative_tokens, for
every b with b x q < VERIFY_GRAPH_MAX_ROWS. ``VerifyGraphs(batch_sizes, shapes)``: those shapes as data;
``.graph_for(batch, q)``: the (b, q) a step of ``batch`` sequences whose longest carries q tokens replays
(the smallest graph batch >= batch), or None when no captured graph covers it (the step runs eagerly);
``.covers_batch(batch)``: some q has a graph for that batch.
Why the row bound: from GROUPED_MIN_TOKENS rows the MoE takes the dequantize-every-expert path (a GB-scale
temporary inside the graph's memory pool, and a host sync below sm80): verify graphs stay on the Triton MoE
paths, which are capturable on every card.
"""
from __future__ import annotations

from dataclasses import dataclass

from onecard.kernels.paths import GROUPED_MIN_TOKENS

DECODE_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
VERIFY_GRAPH_MAX_ROWS = GROUPED_MIN_TOKENS          # b x q stays below this


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in DECODE_GRAPH_SIZES if b <= max_num_seqs]
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def verify_graph_shapes(batch_sizes: list[int], num_speculative_tokens: int) -> list[tuple[int, int]]:
    return [(b, q) for b in sorted(set(batch_sizes)) for q in range(2, 2 + num_speculative_tokens)
            if b * q < VERIFY_GRAPH_MAX_ROWS]


@dataclass(frozen=True, slots=True)
class VerifyGraphs:
    batch_sizes: tuple[int, ...]
    shapes: frozenset[tuple[int, int]]

    @staticmethod
    def of(max_num_seqs: int, num_speculative_tokens: int) -> VerifyGraphs:
        sizes = graph_batch_sizes(max_num_seqs)
        return VerifyGraphs(tuple(sizes), frozenset(verify_graph_shapes(sizes, num_speculative_tokens)))

    def graph_for(self, batch: int, q: int) -> tuple[int, int] | None:
        b = next((x for x in self.batch_sizes if x >= batch), None)
        return (b, q) if b is not None and (b, q) in self.shapes else None

    def covers_batch(self, batch: int) -> bool:
        """Does some verify graph serve a step of ``batch`` sequences (for some q)?"""
        b = next((x for x in self.batch_sizes if x >= batch), None)
        return any(s[0] == b for s in self.shapes)
