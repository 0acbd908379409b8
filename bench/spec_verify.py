"""Speculative decoding on the full-size shape (issue 30): verify-step latency, the expert union, the projected
speed-up on the code-edit workload, and end-to-end tok/s with and without speculation — one GPU call.

Usage (repo root, a GPU, the checkpoint of ``python bench/full_size.py build /tmp/q30``):
  python bench/spec_verify.py /tmp/q30 OUT_DIR [--acceptance ACC.json] [--parts verify,e2e,random]
         [--contexts 512,8192,32768] [--split-small-q off|on|ab]
CPU smoke of the same code (bundled tiny MoE coder, tiny shapes, no CUDA graphs):
  python bench/spec_verify.py --device cpu --tiny OUT_DIR [--contexts 32,96]
Writes OUT_DIR/spec_verify.json (OUT_DIR/spec_e2e.json when the parts lack verify: bench/run_h200.sh runs
verify and e2e,random as two processes, each under its own timeout). Its "cards" entry is the measured table onecard/core/spec/cost.py reads
(``CostModel.for_card(name, shape, table_path=OUT_DIR/spec_verify.json)``).

Parts:
  verify  one engine without speculation; for batch B in (1, 16) and tokens per sequence t in 1..9, a verify
          step = one forward of B sequences with t new query tokens each over a 512-token KV context (the
          chunked-prefill attention path, split-KV from paths.SPLIT_MIN_SEQ_LEN keys while paths.small_q_split(), the
          default; t = 1 is the decode path, split-KV), logits at every position and their
          argmax, as the verifier needs: GPU time by CUDA events, median of REPEATS, eager and replayed from a
          CUDA graph captured here (as the runner's decode and verify graphs run them). The table adds the host time of a
          plain decode step (engine TPOT at B minus the graph GPU time at t = 1). The expert union: one
          eager pass per (B, t) with the router's top-k recomputed in fp32 from norm_moe's inputs, distinct
          experts per layer averaged over layers, against E·(1 − (1 − K/E)^n) (random weights and random
          tokens: near-uniform routing, so this checks the formula and the counting, not a trained model's
          locality).
          ``--contexts`` (default 512): the first context is measured as above (its table keeps the JSON's
          top-level keys); every further context at t in LONG_TOKENS, REPEATS_LONG repeats, batch 16 only up to
          BATCH16_MAX_CONTEXT (KV memory), no union pass (routing does not depend on the context), the first
          context's host time added; the card entry's "contexts" holds every context's rows (cost.py's schema).
  project the projected decode speed-up on the code-edit workload from the table and the acceptance JSON of
          bench/spec_acceptance.py (``--acceptance``): for each method and draft length k, the mean accepted
          length a_k of its histogram, speed-up = (1 + a_k) · T(B, 1) / T(B, 1 + k); and the fitted per-token
          acceptance α for the policy. DERIVED (a measured table x a measured CPU acceptance), not measured.
  e2e     one speculative engine (ngram, k = 8) whose CUDA graphs cover the verify steps (runner/cuda_graphs.py;
          their capture time and memory recorded), greedy runs of E2E_TOKENS at batch 1 and 16 over 512-token
          random prompts, median of 3 each: (a) speculation off, synchronous loop; (b) off, the default loop
          (async scheduling, the GPU default without speculation: the same engine with its loop switched); (c)
          teacher-forced drafts of (a)'s output (each draft token corrupted with probability 1 − α, seeded) at
          α in ALPHAS and the edit workload's fitted α (--acceptance: its lowest and highest edit method), the
          adaptive policy on this call's measured table, plus fixed k at the highest α; tok/s, the ratio to (b)
          and to (a), tokens equal to (a)'s, acceptance, how many steps replayed a verify graph.
  random  (d) the same engine, the random prompts, its own ngram drafter and the policy (target >= 0.97 x (b)).
``--split-small-q`` (split-KV of verify steps' attention, kernels/paths switch "small_q_split"; on by default since
its A/B): "on" runs everything with it on (the table then measures it); "ab" measures the verify part off (the table, as
today) and then again on, in the same engine, and writes both per context, batch and t under "split_small_q_ab"
(graph and eager GPU seconds, on / off ratios). The split only applies from paths.SPLIT_MIN_SEQ_LEN keys.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_verify_project import load_acceptance, load_steps_by_draft_len, project

from onecard.core.spec.cost import CostModel, MeasuredTable, ModelShape, card_spec, expected_distinct_experts
from onecard.kernels import paths

REPEATS = 7
REPEATS_LONG = 3                      # contexts after the first (time-bounded: the part runs under run_h200.sh's timeout)
LONG_TOKENS = (1, 2, 3, 5, 9)         # tokens per sequence measured at contexts after the first
BATCH16_MAX_CONTEXT = 8192            # batch 16 x a longer context does not fit the KV cache beside the weights
NEW_TOKENS = 192                      # per request, verify part's engine TPOT
E2E_TOKENS = 256                      # per request, each end-to-end run
ALPHAS = (0.0, 0.8, 0.95)              # teacher-forced acceptance (0: every draft wrong, the policy's worst case)
#                                        (+ the edit workload's fitted α, with --acceptance)
TINY = "onecard/data/onecard-tiny-coder"


class Setup:
    def __init__(self, tiny: bool, device: str, contexts: tuple[int, ...] | None = None):
        self.tiny, self.device = tiny, device
        self.batches = (1, 2) if tiny else (1, 16)
        self.tokens = range(1, 3) if tiny else range(1, 10)
        self.contexts = contexts or ((32,) if tiny else (512,))
        self.context = self.contexts[0]
        self.max_model_len = max(512 if device == "cpu" else 4096, max(self.contexts) + 64)
        self.new_tokens = 6 if tiny else NEW_TOKENS
        self.e2e_tokens = 6 if tiny else E2E_TOKENS
        self.k = 2 if tiny else 8
        self.repeats = 1 if tiny else REPEATS
        self.e2e_repeats = 1 if tiny else 3

    def plan(self, ctx: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(batches, tokens per sequence, repeats) measured at context ``ctx``."""
        if ctx == self.context:
            return tuple(self.batches), tuple(self.tokens), self.repeats
        batches = tuple(b for b in self.batches if self.tiny or b <= 1 or ctx <= BATCH16_MAX_CONTEXT)
        tokens = tuple(self.tokens) if self.tiny else LONG_TOKENS
        return batches, tokens, min(self.repeats, REPEATS_LONG)


def engine(model_dir: str, s: Setup, spec: dict | None = None):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    if s.device == "cpu":
        args = {"model": model_dir, "device": "cpu", "max_model_len": s.max_model_len, "max_num_seqs": 16,
                "max_num_batched_tokens": 512, "enable_prefix_caching": False}
    else:
        args = {"model": model_dir, "quantization": "gptq", "dtype": "float16", "max_model_len": s.max_model_len,
                "max_num_seqs": 16, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85,
                "enable_prefix_caching": False}
    if spec is not None:
        args["speculative_config"] = spec
    return EngineCore(EngineArgs(**args).create_config())


def card_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


# ------------------------------------------------------------------ verify steps
class VerifyStep:
    """Static inputs of one verify step: B sequences, t query tokens each, ``ctx`` tokens of KV before them."""

    def __init__(self, runner, batch: int, t: int, ctx: int, vocab: int, gen: torch.Generator):
        from onecard.kernels.attention.metadata import AttentionMetadata

        dev, bs = runner.device, runner.block_size
        per = -(-(ctx + t) // bs)
        if 1 + batch * per > runner.num_blocks:
            raise RuntimeError(f"{batch} x {per} blocks do not fit the KV cache ({runner.num_blocks})")
        table = (1 + torch.arange(batch * per, dtype=torch.int32)).view(batch, per)         # [B, blocks]
        pos = (ctx + torch.arange(t)).repeat(batch)                                          # [B*t]
        rows = torch.arange(batch).repeat_interleave(t)
        slots = table[rows, pos // bs].long() * bs + pos % bs
        self.ids = torch.randint(0, vocab, (batch * t,), generator=gen).to(dev)
        self.pos = pos.to(dev)
        self.md = AttentionMetadata(
            slot_mapping=slots.to(dev), query_start_loc=(torch.arange(batch + 1, dtype=torch.int32) * t).to(dev),
            seq_lens=torch.full((batch,), ctx + t, dtype=torch.int32, device=dev), block_table=table.to(dev),
            max_query_len=t, max_seq_len=ctx + t, num_decode_tokens=batch if t == 1 else 0)
        self.runner = runner

    def __call__(self) -> torch.Tensor:
        r = self.runner
        hidden = r.model(self.ids, self.pos, r.kv_caches, self.md)                          # [B*t, H]
        return r.model.compute_logits(hidden).argmax(-1)                                    # [B*t]


def _gpu_median(fn, repeats: int, cuda: bool) -> float:
    times = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graph(step: VerifyStep):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        step()
    return g.replay


class UnionCounter:
    """Counts distinct routed experts per layer by recomputing norm_moe's routing in fp32 (eager only)."""

    def __init__(self):
        from onecard.kernels import dispatch

        self.dispatch, self.orig, self.layers = dispatch, dispatch.norm_moe, []

    def __enter__(self):
        def wrapped(x, residual, norm_weight, eps, gate, *rest):
            top_k = rest[3]
            s = x.float() + residual.float()                                                 # [T, H]
            h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
            ids = (h @ gate.float().t()).topk(top_k, dim=-1).indices                         # [T, K]
            self.layers.append(int(ids.unique().numel()))
            return self.orig(x, residual, norm_weight, eps, gate, *rest)

        self.dispatch.norm_moe = wrapped
        return self

    def __exit__(self, *exc):
        self.dispatch.norm_moe = self.orig


@torch.inference_mode()
def verify_part(core, s: Setup, cfg: dict) -> dict:
    """The first context's timings at the top level (today's keys); every context's under "contexts"."""
    shape = ModelShape.from_hf_config(cfg)
    gen = torch.Generator().manual_seed(7)
    per = {ctx: _verify_context(core.runner, s, shape, ctx, gen) for ctx in s.contexts}
    first = per[s.context]
    return {"context": s.context, **first, "contexts": {c: {k: v for k, v in r.items() if k != "union"}
                                                         for c, r in per.items()}}


def _verify_context(runner, s: Setup, shape: ModelShape, ctx: int, gen: torch.Generator) -> dict:
    cuda = runner.device.type == "cuda"
    batches, tokens, repeats = s.plan(ctx)
    out: dict = {"batches": batches, "tokens": tokens, "repeats": repeats, "eager_s": {}, "graph_s": {},
                 "graph_errors": {}, "union": {}}
    for b in batches:
        for key in ("eager_s", "graph_s", "union"):
            out[key][b] = {}
        for t in tokens:
            step = VerifyStep(runner, b, t, ctx, shape.vocab, gen)
            step()
            out["eager_s"][b][t] = _gpu_median(step, repeats, cuda)
            if cuda:
                try:
                    replay = _graph(step)
                    out["graph_s"][b][t] = _gpu_median(replay, repeats, cuda)
                    del replay
                except Exception as e:
                    out["graph_errors"][f"{b}x{t}"] = repr(e)[:300]
                    torch.cuda.synchronize()
            if shape.num_experts and ctx == s.context:
                with UnionCounter() as uc:
                    step()
                n = b * t
                out["union"][b][t] = {"tokens": n, "observed": statistics.fmean(uc.layers),
                                      "formula": expected_distinct_experts(n, shape.num_experts, shape.top_k)}
            print(f"verify ctx={ctx} B={b} t={t}: eager {out['eager_s'][b][t] * 1e3:.3f} ms"
                  + (f", graph {out['graph_s'][b][t] * 1e3:.3f} ms" if t in out["graph_s"][b] else ""), flush=True)
    return out


def split_ab(core, s: Setup, cfg: dict, off: dict) -> dict:
    """The verify part again with split-KV of small-q launches on, at the contexts where it splits (from
    SPLIT_MIN_SEQ_LEN - 1: a step's bound is ctx + t); per context, batch and t: GPU seconds off and on (graph
    replay and eager) and on / off."""
    shape, gen = ModelShape.from_hf_config(cfg), torch.Generator().manual_seed(7)
    paths.set_switch("small_q_split", True)
    try:                                                                  # shorter contexts do not split
        on = {ctx: _verify_context(core.runner, s, shape, ctx, gen) for ctx in s.contexts
              if ctx + 1 >= paths.SPLIT_MIN_SEQ_LEN}
    finally:
        paths.set_switch("small_q_split", False)
    out: dict = {}
    for ctx, r_on in on.items():
        r_off = off["contexts"][ctx]
        out[ctx] = {kind: {b: {t: {"off": r_off[kind][b][t], "on": r_on[kind][b].get(t),
                                   "on_over_off": (r_on[kind][b][t] / r_off[kind][b][t]
                                                   if r_on[kind][b].get(t) else None)}
                               for t in row} for b, row in r_off[kind].items()}
                    for kind in ("graph_s", "eager_s")}
        for b, row in out[ctx]["graph_s"].items():
            print(f"split-small-q A/B ctx={ctx} B={b}: " + ", ".join(
                f"t={t} {x['off'] * 1e3:.2f} -> {x['on'] * 1e3:.2f} ms" for t, x in row.items() if x["on"]),
                flush=True)
    return out


def card_rows(r: dict, host: dict[int, float]) -> dict:
    """One context's table rows (cost.py's schema): GPU time + the plain step's host time at that batch; graph
    replays where every t of a batch has one, else the eager timings."""
    step_s, eager_s, graphed = {}, {}, True
    for b, row in r["eager_s"].items():
        g = r["graph_s"].get(b, {})
        full = len(g) == len(row)
        graphed = graphed and full
        step_s[b] = {t: (g[t] if full else row[t]) + host[b] for t in row}
        eager_s[b] = {t: row[t] + host[b] for t in row}
    return {"step_s": step_s, "eager_step_s": eager_s, "timing": "graph" if graphed else "eager"}


def union_correction(union: dict, top_k: int) -> float:
    """Mean of (observed − K) / (formula − K) where the formula exceeds K by more than one expert."""
    r = [(u["observed"] - top_k) / (u["formula"] - top_k) for row in union.values() for u in row.values()
         if u["formula"] - top_k > 1.0]
    return statistics.fmean(r) if r else 1.0


# ------------------------------------------------------------------ engine runs
def run(core, prompts: list[list[int]], new: int, tokens: dict | None = None) -> float:
    """Greedy ``new`` tokens per prompt; decode tok/s over the batch (first token to last, all requests). The
    loop is the core's (``core.async_scheduling``); the synchronous loop syncs the GPU after each step (its step
    already waited for the sampled ids), the async one never does (that would undo its overlap)."""
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [f"sv{time.time_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        core.add_request(EngineRequest(rid, list(p), sp, time.monotonic(), []))
    first: float | None = None
    count = 0
    sync = core.runner.device.type == "cuda" and not core.async_scheduling
    while core.has_unfinished():
        outs = core.step()
        if sync:
            torch.cuda.synchronize()
        now = time.perf_counter() - t0
        for o in outs:
            if first is None and o.new_token_ids:
                first = now
                count -= 1                                   # the first token is the prefill's
            count += len(o.new_token_ids)
            if tokens is not None:
                tokens.setdefault(ids.index(o.request_id), []).extend(o.new_token_ids)
    return count / max(1e-9, now - (first or 0.0))


def engine_tpot(core, s: Setup, vocab: int) -> dict[int, float]:
    g = torch.Generator().manual_seed(11)
    res = {}
    for b in s.batches:
        prompts = [torch.randint(0, vocab, (s.context,), generator=g).tolist() for _ in range(b)]
        run(core, prompts, 4)
        res[b] = b / statistics.median(run(core, prompts, s.new_tokens) for _ in range(s.repeats // 2 + 1))
    return res


class TeacherForcedDrafter:
    """Proposes the reference continuation (the non-speculative greedy output), each draft token replaced by
    another with probability 1 − α, seeded by (prompt, position): acceptance is geometric in α. A request's
    reference is found by its prompt once, then kept by request id (the drafter's host time is the engine's)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], alpha: float, vocab: int, seed: int = 0):
        self.reference, self.alpha, self.vocab, self.seed = reference, alpha, vocab, seed
        self._by_req: dict[str, tuple[int, tuple[int, ...], list[int]] | None] = {}

    def _find(self, req_id, tokens):
        if req_id not in self._by_req:
            self._by_req[req_id] = next(((len(p), p[:4], c) for p, c in self.reference.items()
                                         if len(tokens) >= len(p) and tuple(tokens[:len(p)]) == p), None)
        return self._by_req[req_id]

    def propose(self, req_id, tokens, max_k: int) -> list[int]:
        hit = self._find(req_id, tokens)
        if hit is None:
            return []
        n, head, cont = hit
        done = len(tokens) - n
        out = list(cont[done:done + max_k])
        rng = random.Random(f"{self.seed}:{head}:{len(tokens)}")                       # deterministic per position
        return [t if rng.random() < self.alpha else (t + 1) % self.vocab for t in out]

    def observe(self, req_id, tokens) -> None:
        pass

    def finish(self, req_id, tokens) -> None:
        self._by_req.pop(req_id, None)


def _replays(core) -> dict:
    g = getattr(core.runner, "graphs", None)
    return dict(g.replays) if g is not None else {}


def _measure(core, prompts, new: int, reps: int, ref: dict | None, spec=None, policy=None) -> dict:
    """``reps`` runs with the core's current loop and speculator: median tok/s, every run's tokens == ``ref``
    (None: the first run becomes the reference, returned as "tokens"), and the steps' graph coverage."""
    steps0, rep0 = core.num_steps, _replays(core)
    if spec is not None and hasattr(spec, "policy"):
        spec.policy = policy
    before = spec.stats() if spec is not None else None
    rates, equal, first = [], True, None
    for _ in range(reps):
        got: dict[int, list[int]] = {}
        rates.append(run(core, prompts, new, got))
        if ref is None and first is None:
            first = got
        else:
            equal = equal and got == (ref if ref is not None else first)
    rep1 = _replays(core)
    delta = {k: rep1.get(k, 0) - rep0.get(k, 0) for k in rep1}
    out = {"tok_s": statistics.median(rates), "tok_s_runs": rates, "tokens_equal": equal,
           "steps": core.num_steps - steps0, "graph_steps": sum(delta.values()),
           "verify_graph_steps": sum(n for (_, q), n in delta.items() if q > 1),
           "verify_graph_shapes": sorted(f"{b}x{q}" for (b, q), n in delta.items() if q > 1 and n)}
    if spec is not None:
        after = spec.stats()
        drafted = after.num_draft_tokens - before.num_draft_tokens
        out.update(draft_tokens=drafted, policy=policy is not None, verified_seqs=after.num_drafts - before.num_drafts,
                   acceptance=(after.num_accepted_tokens - before.num_accepted_tokens) / max(1, drafted))
    if first is not None:
        out["tokens"] = first
    return out


def e2e_engine(model_dir: str, s: Setup, k: int):
    """The speculative engine (``ngram``, k drafts), built with steps in flight allowed (the GPU default; forced
    here so that the CPU smoke runs the same loops) so that one engine can run both loops: the runs switch
    ``core.async_scheduling`` (speculative runs: the default hybrid loop, engine_core.py)."""
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore

    args = ({"model": model_dir, "device": "cpu", "max_model_len": 512, "max_num_seqs": 16,
             "max_num_batched_tokens": 512, "enable_prefix_caching": False} if s.device == "cpu" else
            {"model": model_dir, "quantization": "gptq", "dtype": "float16", "max_model_len": 4096,
             "max_num_seqs": 16, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85,
             "enable_prefix_caching": False})
    cfg = EngineArgs(**args, speculative_config={"method": "ngram", "num_speculative_tokens": k}).create_config()
    cfg.scheduler.async_scheduling = True
    t0 = time.perf_counter()
    core = EngineCore(cfg)
    return core, time.perf_counter() - t0


def e2e_part(model_dir: str, s: Setup, shape: ModelShape, card: str, parts: set[str],
             alphas: tuple[float, ...] = ALPHAS, table_path: Path | None = None, save=None) -> dict:
    """Per batch: (a) off, synchronous loop; (b) off, async loop (the GPU default); (c) teacher-forced drafts at
    each α with the adaptive policy (and fixed k at the highest α); (d) random prompts, the engine's ngram
    drafter, the policy. (c) and (d) run the default loop with speculation: the hybrid async loop (plain steps
    pipelined, verify steps synchronous). Verify steps replay the engine's own verify graphs (GPU)."""
    if s.device == "cuda":
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
    core, ready_s = e2e_engine(model_dir, s, s.k)
    graphs = getattr(core.runner, "graphs", None)
    res: dict = {"engine_ready_s": ready_s, "new_tokens": s.e2e_tokens, "repeats": s.e2e_repeats,
                 "capture": dict(graphs.capture_stats) if graphs is not None else None,
                 "verify_graph_shapes": len(graphs.verify_shapes) if graphs is not None else 0}
    if s.device == "cuda":
        res["engine_device_bytes"] = free0 - torch.cuda.mem_get_info()[0]
    spec = core.scheduler.speculator
    own_drafter = spec.drafter
    engine_policy = spec.policy
    cost = engine_policy.cost if engine_policy is not None else None
    if cost is not None and table_path is not None and table_path.exists():   # this call's measured table,
        measured = CostModel.for_engine(core.config, card, table_path)         # priced as the engine runs
        cost = measured if measured.table is not None else cost
    res["policy_cost"] = None if cost is None else cost.source

    def policy():
        if cost is None:
            return None
        from onecard.core.spec.policy import SpecPolicy

        return SpecPolicy(s.k, cost)                    # fresh evidence for each variant

    vocab = shape.vocab
    g = torch.Generator().manual_seed(5)
    for b in s.batches:
        prompts = [torch.randint(0, vocab, (s.context,), generator=g).tolist() for _ in range(b)]
        core.scheduler.speculator = None
        core.async_scheduling = False
        run(core, prompts, 4)
        sync = _measure(core, prompts, s.e2e_tokens, s.e2e_repeats, None)
        ref = sync.pop("tokens")
        core.async_scheduling = True
        run(core, prompts, 4)
        asy = _measure(core, prompts, s.e2e_tokens, s.e2e_repeats, ref)
        row: dict = {"off_sync": sync, "off_async": asy}
        core.scheduler.speculator = spec                 # the speculative runs: the hybrid async loop
        runs: list[tuple[str, object, object]] = []
        if "e2e" in parts:
            reference = {tuple(p): ref[i] for i, p in enumerate(prompts)}
            for a in alphas:
                runs.append((f"teacher_alpha{a:.3f}", TeacherForcedDrafter(reference, a, vocab), policy()))
            runs.append((f"teacher_alpha{max(alphas):.3f}_fixed_k", TeacherForcedDrafter(reference, max(alphas), vocab),
                         None))
        if "random" in parts:
            runs.append(("random_ngram", own_drafter, policy()))
        for name, drafter, pol in runs:
            spec.drafter = drafter
            r = _measure(core, prompts, s.e2e_tokens, s.e2e_repeats, ref, spec, pol)
            r["vs_off_async"] = r["tok_s"] / asy["tok_s"]
            r["vs_off_sync"] = r["tok_s"] / sync["tok_s"]
            row[name] = r
        spec.drafter, spec.policy = own_drafter, engine_policy
        res[b] = row
        print(f"e2e B={b}: " + json.dumps(row), flush=True)
        if save is not None:
            save(res)                       # partial results survive the part's timeout
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="checkpoint (default: /tmp/q30; --tiny: the bundled coder)")
    ap.add_argument("out", nargs="?", default=None, help="output directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    ap.add_argument("--acceptance", default=None, help="bench/spec_acceptance.py JSON")
    ap.add_argument("--parts", default="verify,e2e,random")
    ap.add_argument("--split-small-q", choices=("off", "on", "ab"), default="on",
                    help="split-KV of verify steps: off, on (the default: the serving one), or the verify part both ways (A/B)")
    ap.add_argument("--contexts", default=None,
                    help="verify part: comma-separated KV contexts (default 512; --tiny: 32), the first at full detail")
    a = ap.parse_args(argv)
    if a.out is None and a.model is not None and a.tiny:
        a.model, a.out = None, a.model
    model = a.model or (TINY if a.tiny else "/tmp/q30")
    out_dir = Path(a.out or "/tmp/spec_verify")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = set(a.parts.split(","))
    s = Setup(a.tiny, a.device, tuple(int(c) for c in a.contexts.split(",")) if a.contexts else None)
    cfg = json.loads((Path(model) / "config.json").read_text())
    shape = ModelShape.from_hf_config(cfg)
    card = card_name(a.device)
    res: dict = {"card": card, "model": model, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "split_small_q": a.split_small_q}
    paths.set_switch("small_q_split", a.split_small_q == "on")               # for the whole run ("ab": the A/B below)
    t0 = time.perf_counter()
    table = None
    if "verify" in parts:
        core = engine(model, s, None)
        v = verify_part(core, s, cfg)
        if a.split_small_q == "ab":
            res["split_small_q_ab"] = split_ab(core, s, cfg, v)
        tpot = engine_tpot(core, s, shape.vocab)
        host = {b: max(0.0, tpot[b] - v["graph_s"].get(b, {}).get(1, v["eager_s"][b][1])) for b in s.batches}
        rows = {ctx: card_rows(r, host) for ctx, r in v["contexts"].items()}
        corr = union_correction(v["union"], shape.top_k) if shape.num_experts else 1.0
        res["verify"] = {**v, "engine_tpot_s": tpot, "host_s": host}
        first = rows[s.context]
        step_s, eager = first["step_s"], first["eager_step_s"]
        res["cards"] = {card: {"context": s.context, "step_s": step_s, "eager_step_s": eager, "union_correction": corr,
                               "timing": first["timing"], "contexts": rows}}
        table = MeasuredTable.from_json(res["cards"][card])
        model_cost = CostModel(shape, card_spec(card if a.device == "cuda" else "H200"), table)
        res["relative_cost"] = {b: {t: step_s[b][t] / step_s[b][1] for t in s.tokens} for b in s.batches}
        res["analytic_relative_cost"] = {
            b: {t: model_cost.analytic(b, b * t, s.context) / model_cost.analytic(b, b, s.context) for t in s.tokens}
            for b in s.batches}
        del core
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.acceptance and table is not None:
        res["projection"] = project(load_acceptance(a.acceptance), table, s.batches,
                                    load_steps_by_draft_len(a.acceptance))
    if parts & {"e2e", "random"}:
        alphas = ALPHAS
        if a.acceptance:                       # the workloads' own per-token acceptance (edit workload rows)
            fitted = project(load_acceptance(a.acceptance), None, (),
                             load_steps_by_draft_len(a.acceptance))["alpha_at_max_k"]
            res["fitted_alpha"] = fitted
            edit = [x for m, x in fitted.items() if m.startswith("edit:")] or list(fitted.values())
            alphas = tuple(sorted(set(ALPHAS) | {round(min(edit), 2), round(max(edit), 2)}))   # time-bounded
        path = out_dir / ("spec_verify.json" if "verify" in parts else "spec_e2e.json")

        def save(e2e: dict) -> None:
            path.write_text(json.dumps({**res, "e2e": e2e, "partial": True}, indent=1, default=str))

        try:
            res["e2e"] = e2e_part(model, s, shape, card, parts, alphas, out_dir / "spec_verify.json", save)
        except Exception as e:                 # the verify figures above still get written
            res["e2e"] = {"error": repr(e)[:500]}
            print(f"e2e failed: {e!r}", flush=True)
    res["wall_s"] = time.perf_counter() - t0
    path = out_dir / ("spec_verify.json" if "verify" in parts else "spec_e2e.json")
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
