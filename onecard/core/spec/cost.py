"""Cost of a speculative verify step on an MoE model: seconds for ``batch`` decode sequences carrying 1 + k_i
query tokens each (process B, pure Python, no torch).

Contract:
  ``expected_distinct_experts(n, num_experts, top_k)`` = E·(1 − (1 − K/E)^n): the expected number of distinct
  experts one layer reads for n routed tokens (the one home of this formula; bench/full_size.py imports it).
  ``gptq_weight_bytes(k, n, bits, group_size)``: bytes a kernel reads for one GPTQ weight [K, N] (nibbles, fp16
  scales, packed zeros; bits None = an fp16 weight).
  ``ModelShape.from_hf_config(config, bits=4, group_size=128)``: the sizes the model below needs.
  ``CARDS`` / ``card_spec(name)``: per-card constants of the analytic model (documented below, assumptions
  marked). ``CostModel(shape, card, table=None)``; ``CostModel.for_card(name, shape, table_path=None)`` takes
  the measured table of that card from a ``bench/spec_verify.py`` JSON when there is one;
  ``CostModel.for_engine(engine_config, card, table_path=SHIPPED_TABLES, eager=None)`` builds the shape from an
  ``EngineConfig``, reads the card's table from the shipped measurements and prices steps as the engine runs them
  (``eager_mode(engine_config)`` and the engine's verify graphs, below).
  ``step_time(batch, tokens, context=512) -> s``: one step of ``batch`` decode sequences and ``tokens`` query
  tokens in all (tokens >= batch; non-integer tokens per sequence interpolate). ``verify_cost(batch,
  k_per_seq, context=512) -> s`` = step_time(len(k_per_seq), Σ(1 + k_i)); ``relative_cost`` = that over the
  same batch at k = 0. Deterministic; no clocks.

Analytic model (no table for the card):
  T = overhead + max(bytes / bandwidth, flops / flop_rate + dequantized weights / dequant_rate) (a roofline per
  step), with, for n = Σ(1+k_i) query tokens of ``batch`` sequences at ``context`` tokens each:
    bytes = attention GEMMs + router + lm_head (every layer, once per step: weights are read once whatever n)
            + layers x U(n) x one expert's three GEMMs + batch x context x KV bytes per token (the multi-query
            attention path reads each sequence's KV once per step, not once per query token);
    U(n)  = expected_distinct_experts(n): the routing of the n tokens is assumed independent and uniform over
            the experts. Tokens of one sequence route alike more often than that (consecutive code tokens), which
            makes the real union smaller: ``union_correction`` (measured U / formula U at the bench's n, from the
            table) scales U(n) − top_k, so a measured correction carries over to other n;
    flops = n x 2 x (active parameters incl. lm_head, which every verified position needs) + attention
            4 x n x context x heads x head_dim per layer;
    dequantized weights = layers x U(n) x expert weights (the cards whose Triton tl.dot is FMA code pay for
            the int4 → fp16 conversion in compute: sm70/75; elsewhere it hides under the memory stream);
    kernel paths (kernels/paths.py at the card's capability and n rows): where the dense GEMMs take the
            dequantize + cuBLAS path (n >= 128, 65 below sm80) their fp16 copies are written and read (2 x
            their fp16 bytes more); where the MoE takes the grouped / per-expert path (n >= 256) every expert
            is read, dequantized, written and read again — the policy must not push a step there.
  Card constants: H200 ``overhead`` and ``bandwidth`` are fitted (two points, both memory-bound) to the measured
  decode TPOT of run T4 (BENCHMARKS.md: 2.59 ms at batch 1, 6.49 ms at batch 16, 512-token contexts, steps reading 2.11 / 11.6
  GB): the overhead is the per-step latency chain (launches, dependent kernels, host), the bandwidth what the
  decode kernels reach (not the 4.26 TB/s copy rate). H100 (assumed): the same overhead and the same fraction
  of its HBM (3.35 TB/s spec). V100 (from bench/v100_estimate.py's model, itself an assumption): 750 GB/s,
  Triton tl.dot as FMA at 15.7 TFLOP/s, 4 integer ops per dequantized weight, overhead = the batch-1 latency
  excess of that estimate (3.46 − 2.83 ms) + the H200's measured host time per step (0.13 ms). flop_rate for
  sm80+ is an assumption (400 TFLOP/s: ~40% of the dense fp16 tensor-core peak at these skinny shapes).
Measured table (preferred): ``{"cards": {CARD: {"context": 512, "step_s": {BATCH: {TOKENS_PER_SEQ: s}},
  "eager_step_s": {...} (optional), "union_correction": c}}}`` (bench/spec_verify.py writes it; step_s are CUDA-graph
  replays, eager_step_s the same steps run eagerly). ``onecard/data/spec_verify_tables.json`` ships one (H100). For a batch in the table, T(tokens per seq)
  interpolates the row linearly (extrapolating its last two points); for another batch, the analytic
  relative cost is scaled by the table's / the model's relative cost at the nearest measured batch (log scale).
  Several contexts: the card entry may add ``"contexts": {CTX: {"step_s": {...}, "eager_step_s": {...}}}``
  (CTX a token count; the top-level ``context``/``step_s``/``eager_step_s`` stay the first measured context, so a
  reader of one context sees today's table; ``contexts`` may repeat it). T at context C: each measured context c
  prices the step as above (T_c), then T is linear in C between the two measured contexts around it (for a batch
  measured at >= 2 contexts only those contexts are used, else every context with its nearest-batch scaling);
  outside the measured range it extrapolates the nearest two, never below the KV-delta rule from the nearest
  (T_c + batch x (C − c) x KV bytes per token / bandwidth). A single-context table: T_c + that KV delta (as always).
  Unsplit guard: a step with more query tokens than sequences runs paged attention without a split-KV, B x KV
  heads programs over the whole context, unless it is a small-q step (verify) while kernels/paths.small_q_split()
  (on by default since the H100 A/B: ``_unsplit``).
  At a context over ``UNSPLIT_GUARD`` x the table's longest measured context the table says nothing true about
  that, so such a step costs at least T(longest measured) + the extra KV read by B x KV heads programs at
  ``UNSPLIT_PROGRAM_RATE`` each (capped by the bandwidth): an ASSUMED, deliberately low rate (below). The
  analytic model (no table) gets the same guard past UNSPLIT_GUARD x FIT_CONTEXT (its fit's 512-token contexts).
Eager steps (``CostModel.eager``): "none" = every step replayed from a CUDA graph as laid out (what the table's
  step_s and the analytic model describe); "verify" = the engine on a GPU: 1-token decode steps graphed, and verify
  steps graphed where ``verify_graphs`` (runner/graph_shapes.VerifyGraphs, from the engine's config) has a graph for
  them, every other step with more query tokens than sequences (mixed prefill, verify shapes without a graph) eager;
  "all" = no graphs (--enforce-eager, the CPU). A graphed verify step pads every sequence to q = 1 + the step's
  longest draft: ``padded_step_time(batch, q)`` = T(B, B·q) from the graphed rows (None where no graph covers it;
  the policy then prices the step eager). An eager step costs the card's measured eager row when the table has
  one (other batches: the graphed time + the eager excess at the nearest measured batch); otherwise the graphed
  time + ``eager_overhead_s()``: the median eager − graph excess over the shipped H100 measurement's verify shapes
  (H100 80GB HBM3, 2026-12-06: ~27 ms per step, launch/host-bound). For other cards that constant is an
  ASSUMPTION (the excess is host time and kernel launches, so it carries over roughly; a slower host makes it more).
"""
from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from onecard.kernels import paths
from onecard.kv_dtype import bytes_per_token_hf
from onecard.runner.graph_shapes import VerifyGraphs

SHIPPED_TABLES = Path(__file__).resolve().parents[2] / "data" / "spec_verify_tables.json"
EAGER_MODES = ("none", "verify", "all")


def _unsplit(batch: int, tokens: float) -> bool:
    """Does a step of ``tokens`` query tokens over ``batch`` sequences run its paged attention without split-KV?
    Decode-only steps split; a step of more tokens than sequences, priced as ``tokens / batch`` rows per
    sequence, splits where kernels/paths.splits_small_q says so (verify steps), else not (mixed prefill)."""
    return tokens > batch and not paths.splits_small_q(math.ceil(tokens / batch))


def expected_distinct_experts(n: float, num_experts: int, top_k: int) -> float:
    """E[|∪ routed sets|] for n tokens, each routed to top_k of num_experts experts uniformly and independently:
    each expert is missed by one token with probability 1 − K/E, by all n with (1 − K/E)^n."""
    if n <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n)


def gptq_weight_bytes(k: int, n: int, bits: int | None = 4, group_size: int = 128) -> float:
    """Bytes one weight [K, N] costs to read: packed codes, fp16 scales and packed zeros (GPTQ), or fp16."""
    if bits is None:
        return 2.0 * k * n
    groups = math.ceil(k / group_size) if group_size > 0 else 1
    return k * n * bits / 8 + groups * n * 2 + groups * n * bits / 8


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int              # 0 = a dense model
    top_k: int
    expert_intermediate: int      # moe_intermediate (MoE) or intermediate (dense MLP)
    kv_bytes_per_token: int
    bits: int | None = 4          # None: fp16 weights
    group_size: int = 128

    @staticmethod
    def from_hf_config(c: dict[str, Any], bits: int | None = 4, group_size: int = 128,
                       kv_format: str = "float16") -> ModelShape:
        heads = int(c["num_attention_heads"])
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        inter = int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else int(c["intermediate_size"])
        return ModelShape(
            layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]), heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads), vocab=int(c["vocab_size"]),
            num_experts=experts, top_k=int(c.get("num_experts_per_tok", 1)) if experts else 0,
            expert_intermediate=inter, kv_bytes_per_token=bytes_per_token_hf(c, kv_format), bits=bits,
            group_size=group_size)

    def _w(self, k: int, n: int) -> float:
        return gptq_weight_bytes(k, n, self.bits, self.group_size)

    @property
    def dense_bytes(self) -> float:
        """Weights every step reads once: q/k/v/o per layer, the router (fp16), the fp16 lm_head."""
        h, d = self.hidden, self.head_dim
        attn = self._w(h, (self.heads + 2 * self.kv_heads) * d) + self._w(self.heads * d, h)
        return self.layers * (attn + self.num_experts * h * 2) + self.vocab * h * 2

    @property
    def attention_fp16_bytes(self) -> float:
        """One layer's q/k/v/o weights at fp16 (the copy the cuBLAS path dequantizes to)."""
        d = self.head_dim
        return 2.0 * (self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden)

    @property
    def expert_bytes(self) -> float:
        """One expert's (or the dense MLP's) gate, up and down GEMMs in one layer."""
        return 2 * self._w(self.hidden, self.expert_intermediate) + self._w(self.expert_intermediate, self.hidden)

    def experts_read(self, tokens: float, union_correction: float = 1.0) -> float:
        """Distinct experts (per layer) ``tokens`` routed tokens read; 1 for a dense MLP."""
        if not self.num_experts:
            return 1.0 if tokens > 0 else 0.0
        u = expected_distinct_experts(tokens, self.num_experts, self.top_k)
        k = min(self.top_k, u)
        return k + (u - k) * union_correction

    def flops_per_token(self, context: int) -> float:
        h, d, i = self.hidden, self.head_dim, self.expert_intermediate
        mlp = (self.top_k or 1) * 3 * h * i
        params = self.layers * (h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + mlp
                                + self.num_experts * h) + self.vocab * h
        return 2.0 * params + 4.0 * self.layers * context * self.heads * d


@dataclass(frozen=True, slots=True)
class CardSpec:
    name: str
    bandwidth: float              # bytes/s the decode kernels reach (fitted or assumed; see the module doc)
    overhead_s: float             # per step, whatever its size
    flop_rate: float              # FLOP/s for the verify GEMMs
    dequant_rate: float = math.inf  # weight elements/s converted int4 → fp16 where it costs compute (sm70/75)
    cc: int = 90                  # compute capability: the kernel paths (kernels/paths.py) at each token count
    source: str = "assumed"


# Run T4, H200 (BENCHMARKS.md): measured decode TPOT and the bytes its steps read (bench/full_size.py floor).
H200_T4 = {"copy_bandwidth": 4.26e12, "bytes": {1: 2.11e9, 16: 11.6e9}, "tpot_s": {1: 2.59e-3, 16: 6.49e-3}}
SM80_FLOP_RATE = 400e12           # assumption: ~40% of dense fp16 tensor-core peak at M <= 144
HBM_SPEC = {"H200": 4.8e12, "H100": 3.35e12}
# ASSUMPTION (unmeasured): bytes/s one unsplit paged-attention program (one sequence x one KV head) streams its
# KV at: an H100's HBM share per SM (3.35 TB/s / 132 SMs); a lone CTA may do better, so this errs expensive.
UNSPLIT_PROGRAM_RATE = 25e9
FIT_CONTEXT = 512                 # the contexts of the steps the analytic constants were fitted to (run T4)
UNSPLIT_GUARD = 2.0               # the unsplit rule prices contexts past this x the table's longest measured one
V100_RATES = {"bandwidth": 750e9, "fma": 15.7e12, "dequant_ops": 4, "overhead_s": (3.46 - 2.83 + 0.13) * 1e-3}


def _fit_h200() -> tuple[float, float]:
    """(overhead_s, bandwidth) through T4's two points: T = overhead + bytes / bandwidth (memory-bound there:
    16 x 6.1 GFLOP at SM80_FLOP_RATE is 0.24 ms against 11.6 GB at the fitted 2.4 TB/s, 4.8 ms)."""
    m = H200_T4
    t, b = m["tpot_s"], m["bytes"]
    bw = (b[16] - b[1]) / (t[16] - t[1])
    return t[1] - b[1] / bw, bw


def _cards() -> dict[str, CardSpec]:
    overhead, bw = _fit_h200()
    h100_bw = bw * HBM_SPEC["H100"] / HBM_SPEC["H200"]
    v = V100_RATES
    return {
        "H200": CardSpec("H200", bw, overhead, SM80_FLOP_RATE, source="fitted to run T4 (H200)"),
        "H100-80GB": CardSpec("H100-80GB", h100_bw, overhead, SM80_FLOP_RATE,
                              source="H200 fit scaled by HBM spec (assumed)"),
        "V100-32GB": CardSpec("V100-32GB", v["bandwidth"], v["overhead_s"], v["fma"],
                              v["fma"] / 2 / v["dequant_ops"], cc=70, source="bench/v100_estimate.py rates (assumed)"),
    }


CARDS = _cards()
CARDS["V100-16GB"] = replace(CARDS["V100-32GB"], name="V100-16GB")


def _key(name: str) -> str:
    s = re.sub(r"NVIDIA|TESLA|SXM\d?|PCIE|HBM\dE?|NVL", "", name.upper())
    return "".join(ch for ch in s if ch.isalnum())


def card_name(name: str) -> str:
    """The canonical card name (gpus.GPUS' spelling) for a torch/nvidia-smi name; the name itself if unknown."""
    from onecard.env import ConfigError
    from onecard.gpus import find_gpu

    try:
        return find_gpu(name).name
    except ConfigError:
        return name


def card_spec(name: str) -> CardSpec:
    """Constants for ``name``; an unknown card gets the H100's (said in ``source``)."""
    c = CARDS.get(card_name(name))
    if c is None:
        return replace(CARDS["H100-80GB"], name=name, source=f"unknown card {name!r}: H100 constants")
    return c


@dataclass(slots=True)
class MeasuredTable:
    """One card's measured verify-step latencies: step_s[batch][tokens per sequence] at ``context``; ``more``:
    the tables measured at other contexts (each a one-context MeasuredTable)."""
    context: int
    step_s: dict[int, dict[int, float]]
    union_correction: float = 1.0
    eager_s: dict[int, dict[int, float]] | None = None   # the same steps run eagerly (no CUDA graph), if measured
    more: dict[int, MeasuredTable] = field(default_factory=dict)

    def by_context(self) -> list[MeasuredTable]:
        """Every measured context's table, shortest context first."""
        return sorted([self, *self.more.values()], key=lambda x: x.context)

    @staticmethod
    def _rows(d: dict[str, Any]) -> dict[int, dict[int, float]]:
        """Each row made non-decreasing in tokens (a step with more tokens is never faster: a dip is timing
        noise, and a falling row would make the policy draft for free)."""
        rows: dict[int, dict[int, float]] = {}
        for b, row in d.items():
            mono, top = {}, 0.0
            for t in sorted(row, key=int):
                top = max(top, float(row[t]))
                mono[int(t)] = top
            rows[int(b)] = mono
        if not rows or any(len(r) < 2 for r in rows.values()):
            raise ValueError("a measured table needs, per batch, at least two tokens-per-sequence points")
        return rows

    @staticmethod
    def from_json(d: dict[str, Any]) -> MeasuredTable:
        corr = float(d.get("union_correction") or 1.0)

        def one(ctx: int, x: dict[str, Any]) -> MeasuredTable:
            eager = MeasuredTable._rows(x["eager_step_s"]) if x.get("eager_step_s") else None
            return MeasuredTable(ctx, MeasuredTable._rows(x["step_s"]), corr, eager)

        first = one(int(d.get("context", 512)), d)
        first.more = {int(c): one(int(c), x) for c, x in (d.get("contexts") or {}).items() if int(c) != first.context}
        return first

    def interpolate(self, batch: int, tokens_per_seq: float, eager: bool = False) -> float:
        row = (self.eager_s if eager and self.eager_s is not None else self.step_s)[batch]
        xs = sorted(row)
        lo = max([x for x in xs if x <= tokens_per_seq], default=xs[0])
        hi = min([x for x in xs if x > lo], default=None)
        if hi is None:                                   # past the last point: extend the last segment
            lo, hi = xs[-2], xs[-1]
        return row[lo] + (row[hi] - row[lo]) * (tokens_per_seq - lo) / (hi - lo)


def load_table(path: str | Path, card: str) -> MeasuredTable | None:
    """The table for ``card`` in a bench/spec_verify.py JSON, or None when the file has none for it."""
    data = json.loads(Path(path).read_text())
    want = card_name(card)
    for name, d in (data.get("cards") or {}).items():
        if card_name(name) == want or _key(name) == _key(card):
            return MeasuredTable.from_json(d)
    return None


@functools.cache
def eager_overhead_s(path: Path = SHIPPED_TABLES) -> float:
    """Seconds an eager step costs over the same step replayed from a CUDA graph: the median (eager − graph)
    over the measured verify shapes (t >= 2 tokens per sequence, every batch) of every card in ``path`` (raw
    timings, not the monotone rows). Shipped: H100 80GB HBM3, 2026-12-06; an assumption for other cards."""
    data = json.loads(Path(path).read_text())
    diffs = [float(e[t]) - float(d["step_s"][b][t])
             for d in data["cards"].values() if d.get("eager_step_s")
             for b, e in d["eager_step_s"].items() for t in e if int(t) >= 2 and t in d["step_s"].get(b, {})]
    if not diffs:
        raise ValueError(f"{path}: no eager and graphed timings of the same verify shapes")
    return max(0.0, statistics.median(diffs))


def eager_mode(config: Any) -> str:
    """Which steps of an engine with ``EngineConfig`` ``config`` run without a CUDA graph (see EAGER_MODES)."""
    if config.device != "cuda" or config.enforce_eager:
        return "all"
    return "verify"


def engine_verify_graphs(config: Any) -> VerifyGraphs | None:
    """The verify graphs an engine with ``EngineConfig`` ``config`` captures (runner/graph_shapes.py), or None."""
    spec = getattr(config, "speculative", None)
    if spec is None or eager_mode(config) == "all":
        return None
    return VerifyGraphs.of(config.scheduler.max_num_seqs, spec.num_speculative_tokens)


@dataclass(slots=True)
class CostModel:
    shape: ModelShape
    card: CardSpec
    table: MeasuredTable | None = None
    eager: str = "none"           # EAGER_MODES: which steps run eagerly (the module doc)
    verify_graphs: VerifyGraphs | None = None   # the engine's verify graphs ("verify" mode)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.eager not in EAGER_MODES:
            raise ValueError(f"eager must be one of {EAGER_MODES}, not {self.eager!r}")

    @staticmethod
    def for_engine(config: Any, card: str, table_path: str | Path | None = SHIPPED_TABLES,
                   eager: str | None = None) -> CostModel:
        """From an ``EngineConfig`` (the model's config.json, its GPTQ bits and group, the KV format) on ``card``
        (the device name torch reports, e.g. "NVIDIA H200"); ``eager`` None = ``eager_mode(config)``."""
        from onecard.kv_dtype import resolve

        m = config.model
        q = m.quant
        shape = ModelShape.from_hf_config(m.hf_config, bits=None if q is None else q.bits,
                                          group_size=128 if q is None else q.group_size,
                                          kv_format=resolve(config.cache.kv_cache_dtype, m.dtype))
        m = CostModel.for_card(card, shape, table_path, eager_mode(config) if eager is None else eager)
        m.verify_graphs = engine_verify_graphs(config) if m.eager == "verify" else None
        return m

    @staticmethod
    def for_card(name: str, shape: ModelShape, table_path: str | Path | None = None, eager: str = "none") -> CostModel:
        table = load_table(table_path, name) if table_path is not None and Path(table_path).exists() else None
        return CostModel(shape, card_spec(name), table, eager)

    @property
    def source(self) -> str:
        s = "measured table" if self.table is not None else f"analytic ({self.card.source})"
        if self.eager == "none":
            return s
        graphed = ", verify steps graphed (padded)" if self.verify_graphs is not None else ""
        return f"{s}, eager {self.eager} steps{graphed}"

    def analytic(self, batch: int, tokens: float, context: int = 512) -> float:
        s, c = self.shape, self.card
        corr = self.table.union_correction if self.table is not None else 1.0
        rows = math.ceil(tokens)
        experts = s.experts_read(tokens, corr)
        expert_fp16 = 3 * s.hidden * s.expert_intermediate * 2
        extra = 0.0
        if s.bits is not None and paths.choose_dense_gemm(rows, c.cc) == "cublas":
            extra += 2 * s.layers * s.attention_fp16_bytes          # dequantized copy written, then read by cuBLAS
        if s.bits is not None and s.num_experts and paths.choose_moe(rows, c.cc) in ("grouped", "per-expert"):
            experts = float(s.num_experts)                          # every expert dequantized, written and read
            extra += 2 * s.layers * s.num_experts * expert_fp16
        moe_layers_bytes = s.layers * experts * s.expert_bytes
        kv = batch * context * s.kv_bytes_per_token
        dequant = s.layers * experts * 3 * s.hidden * s.expert_intermediate
        memory = (s.dense_bytes + moe_layers_bytes + kv + extra) / c.bandwidth
        compute = tokens * s.flops_per_token(context) / c.flop_rate + dequant / c.dequant_rate
        return c.overhead_s + max(memory, compute)

    def step_time(self, batch: int, tokens: float, context: int = 512) -> float:
        """Seconds for one step of ``batch`` decode sequences with ``tokens`` query tokens in all."""
        if batch < 1 or tokens < batch:
            raise ValueError(f"a step of {batch} sequences has at least {batch} query tokens, not {tokens}")
        key = (batch, tokens, context)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        t = self._graphed(batch, tokens, context)
        if self.eager == "all" or (self.eager == "verify" and tokens > batch):
            t = self._eager_time(batch, tokens, context, t)
        if len(self._cache) < 65536:
            self._cache[key] = t
        return t

    def _graphed(self, batch: int, tokens: float, context: int) -> float:
        if self.table is not None:
            return self._from_table(batch, tokens, context)
        t = self.analytic(batch, tokens, context)
        if _unsplit(batch, tokens) and context > UNSPLIT_GUARD * FIT_CONTEXT:   # the unsplit guard (module doc)
            t = max(t, self.analytic(batch, tokens, FIT_CONTEXT) + self._unsplit_kv_s(batch, context)
                    - self._unsplit_kv_s(batch, FIT_CONTEXT))
        return t

    def pads_verify(self, batch: int) -> bool:
        """Are verify steps of ``batch`` sequences replayed from padded graphs (for some query length)?"""
        vg = self.verify_graphs
        return vg is not None and self.eager == "verify" and vg.covers_batch(batch)

    def padded_step_time(self, batch: int, q: int, context: int = 512) -> float | None:
        """Seconds of a verify step of ``batch`` sequences replayed from the (b, q) graph: T(B, B·q), every
        sequence padded to q query rows; None when no verify graph covers it (the step would run eagerly)."""
        if q == 1:
            return self.step_time(batch, batch, context)
        if self.verify_graphs is None or self.verify_graphs.graph_for(batch, q) is None:
            return None
        key = ("padded", batch, q, context)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._graphed(batch, batch * q, context)
        return hit

    def _kv_s(self, batch: int, tokens_of_context: float) -> float:
        """Seconds to read ``batch`` x that many tokens of KV at the card's bandwidth (a split decode launch)."""
        return batch * tokens_of_context * self.shape.kv_bytes_per_token / self.card.bandwidth

    def _unsplit_kv_s(self, batch: int, context: float) -> float:
        """Seconds an unsplit paged attention takes to read ``batch`` x ``context`` tokens of KV: B x KV heads
        programs at UNSPLIT_PROGRAM_RATE each, never faster than the bandwidth (the module doc: an assumption)."""
        rate = min(self.card.bandwidth, batch * self.shape.kv_heads * UNSPLIT_PROGRAM_RATE)
        return batch * context * self.shape.kv_bytes_per_token / rate

    def _from_table(self, batch: int, tokens: float, context: int) -> float:
        tb = self.table
        assert tb is not None
        tables = tb.by_context()
        own = [x for x in tables if batch in x.step_s]
        use = own if len(own) >= 2 else tables
        pts = [(x.context, self._at(x, batch, tokens)) for x in use]
        t = _across_contexts(pts, context, lambda c, v: v + self._kv_s(batch, context - c))
        top_ctx, top = pts[-1]
        if _unsplit(batch, tokens) and context > UNSPLIT_GUARD * tables[-1].context:   # unsplit, unmeasured
            t = max(t, top + self._unsplit_kv_s(batch, context) - self._unsplit_kv_s(batch, top_ctx))
        return t

    def _at(self, tb: MeasuredTable, batch: int, tokens: float) -> float:
        """The step at ``tb``'s own context: its row for ``batch``, or the nearest batch's scaled (module doc)."""
        per_seq = tokens / batch
        if batch in tb.step_s:
            return tb.interpolate(batch, per_seq)
        near = min(tb.step_s, key=lambda b: abs(math.log(b) - math.log(batch)))
        measured_rel = tb.interpolate(near, per_seq) / tb.interpolate(near, 1)
        model_rel = self.analytic(near, near * per_seq, tb.context) / self.analytic(near, near, tb.context)
        base = tb.interpolate(near, 1) * self.analytic(batch, batch, tb.context) / self.analytic(near, near, tb.context)
        rel = self.analytic(batch, tokens, tb.context) / self.analytic(batch, batch, tb.context)
        return base * rel * (measured_rel / model_rel)

    def _eager_time(self, batch: int, tokens: float, context: int, graphed: float) -> float:
        """The step run eagerly, given its graphed time (never less than that): from the eager rows of the
        measured context nearest ``context``."""
        eager = [x for x in self.table.by_context() if x.eager_s is not None] if self.table is not None else []
        if not eager:
            return graphed + eager_overhead_s()
        per_seq = tokens / batch
        exact = [x for x in eager if batch in x.eager_s]
        if exact:
            tb = min(exact, key=lambda x: abs(x.context - context))
            return max(graphed, tb.interpolate(batch, per_seq, eager=True) + self._kv_s(batch, context - tb.context))
        tb = min(eager, key=lambda x: abs(x.context - context))
        near = min(tb.eager_s, key=lambda b: abs(math.log(b) - math.log(batch)))
        at_near = (tb.interpolate(near, per_seq) if near in tb.step_s
                   else self.analytic(near, near * per_seq, tb.context))
        return graphed + max(0.0, tb.interpolate(near, per_seq, eager=True) - at_near)

    def verify_cost(self, batch: int, k_per_seq: list[int], context: int = 512) -> float:
        """Seconds of a step verifying k_i draft tokens for each of len(k_per_seq) sequences (batch = that)."""
        if batch != len(k_per_seq):
            raise ValueError(f"batch {batch} but {len(k_per_seq)} draft lengths")
        return self.step_time(batch, batch + sum(k_per_seq), context)

    def relative_cost(self, batch: int, k_per_seq: list[int], context: int = 512) -> float:
        """verify_cost over the same batch's plain decode step (k = 0 everywhere)."""
        return self.verify_cost(batch, k_per_seq, context) / self.step_time(batch, batch, context)


def _across_contexts(pts: list[tuple[int, float]], x: float, floor) -> float:
    """Linear in context through ``pts`` ((context, seconds), shortest first) at ``x``; outside them the nearest
    two extrapolate, never below ``floor(nearest context, its seconds)`` (the KV-delta rule)."""
    if len(pts) == 1:
        return floor(*pts[0])
    if pts[0][0] <= x <= pts[-1][0]:
        i = next(i for i in range(1, len(pts)) if x <= pts[i][0])
        (c0, v0), (c1, v1) = pts[i - 1], pts[i]
        return v0 + (v1 - v0) * (x - c0) / (c1 - c0)
    (c0, v0), (c1, v1) = pts[:2] if x < pts[0][0] else pts[-2:]
    near = pts[0] if x < pts[0][0] else pts[-1]
    return max(v0 + (v1 - v0) * (x - c0) / (c1 - c0), floor(*near))
