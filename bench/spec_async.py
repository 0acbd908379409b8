"""Speculative decoding under async scheduling, the GPU's default loop (issue 30: random prompts >= 0.97x without
speculation; drafting off the critical path) — one GPU call.

Usage (repo root, a GPU, the checkpoint of ``python bench/full_size.py build /tmp/q30``):
  python bench/spec_async.py /tmp/q30 OUT_DIR [--table OUT_DIR/spec_verify.json]
CPU smoke of the same code (bundled tiny MoE coder, tiny shapes):
  python bench/spec_async.py --device cpu --tiny OUT_DIR
Writes OUT_DIR/spec_async.json.

One speculative engine (ngram, k = 8), built as bench/spec_verify.py's e2e part builds it (its verify graphs
captured), and for batch B in (1, 16) over 512-token random prompts, greedy, E2E_TOKENS per request, median of
3 runs each (tok/s from the first token to the last):
  off_async        speculator detached, async loop: the default without speculation (the reference);
  off_sync         speculator detached, synchronous loop;
  random_async     the engine's own ngram drafter and its policy on the hybrid loop (core/engine_core.py: plain
                   steps pipelined, the step in flight drained only when a stale proposal and the policy's peek
                   say a verify would pay) — the default loop with --speculative-config now; target >= 0.97x
                   off_async at B = 1 and 16;
  random_sync      the same on the synchronous loop (the default before);
  teacher_*_async  teacher-forced drafts of off_sync's output at alpha = 0.8 and 0.95 (bench/spec_verify.py's
                   TeacherForcedDrafter), the policy, hybrid loop; and alpha = 0.95 on the synchronous loop.
Each row: tok/s, ratio to off_async, tokens equal to off_sync's (every run), draft tokens, acceptance, verified
sequences, and the loop's switch: how often the scheduler was asked to drain and said yes / no.
The policy prices steps with --table (this call's measured verify table, e.g. from ``spec_verify.py --parts
verify``) when given, else the engine's own cost model (the shipped tables).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec_verify as sv

from onecard.core.spec.cost import CostModel, ModelShape

ALPHAS = (0.8, 0.95)


class SwitchCount:
    """Counts the hybrid loop's drain decisions (``Scheduler.drain_pays``) of one engine."""

    def __init__(self, core) -> None:
        self.yes = self.no = 0
        ask = core.scheduler.drain_pays

        def counted() -> bool:
            pays = ask()
            if pays:
                self.yes += 1
            else:
                self.no += 1
            return pays

        core.scheduler.drain_pays = counted

    def since(self, mark: tuple[int, int]) -> dict:
        return {"drains": self.yes - mark[0], "pipelined_asks": self.no - mark[1]}


def measure(core, switch: SwitchCount, loop: str, prompts, s, ref, spec=None, policy=None, off=None) -> dict:
    core.async_scheduling = loop == "async"
    sv.run(core, prompts, 4)                                  # warm this loop and shape
    mark = (switch.yes, switch.no)
    r = sv._measure(core, prompts, s.e2e_tokens, s.e2e_repeats, ref, spec, policy)
    r.update(loop=loop, **switch.since(mark))
    if off is not None:
        r["vs_off_async"] = r["tok_s"] / off
    return r


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="checkpoint (default: /tmp/q30; --tiny: the bundled coder)")
    ap.add_argument("out", nargs="?", default=None, help="output directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    ap.add_argument("--table", default=None, help="spec_verify.json with this card's measured verify table")
    a = ap.parse_args(argv)
    if a.out is None and a.model is not None and a.tiny:
        a.model, a.out = None, a.model
    model = a.model or (sv.TINY if a.tiny else "/tmp/q30")
    out_dir = Path(a.out or "/tmp/spec_async")
    out_dir.mkdir(parents=True, exist_ok=True)
    s = sv.Setup(a.tiny, a.device)
    shape = ModelShape.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
    card = sv.card_name(a.device)
    res: dict = {"card": card, "model": model, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "new_tokens": s.e2e_tokens, "repeats": s.e2e_repeats}
    path = out_dir / "spec_async.json"
    t0 = time.perf_counter()
    core, res["engine_ready_s"] = sv.e2e_engine(model, s, s.k)
    switch = SwitchCount(core)
    spec = core.scheduler.speculator
    own_drafter, engine_policy = spec.drafter, spec.policy
    cost = engine_policy.cost if engine_policy is not None else None
    if cost is not None and a.table and Path(a.table).exists():
        measured = CostModel.for_engine(core.config, card, a.table)
        cost = measured if measured.table is not None else cost
    res["policy_cost"] = None if cost is None else cost.source

    def policy():
        from onecard.core.spec.policy import SpecPolicy

        return None if cost is None else SpecPolicy(s.k, cost)     # fresh evidence for each row

    g = torch.Generator().manual_seed(5)
    for b in s.batches:
        prompts = [torch.randint(0, shape.vocab, (s.context,), generator=g).tolist() for _ in range(b)]
        core.scheduler.speculator = None
        row: dict = {"off_sync": measure(core, switch, "sync", prompts, s, None)}
        ref = row["off_sync"].pop("tokens")
        off = measure(core, switch, "async", prompts, s, ref)
        row["off_async"] = off
        core.scheduler.speculator = spec
        runs = [("random_async", "async", own_drafter), ("random_sync", "sync", own_drafter)]
        reference = {tuple(p): ref[i] for i, p in enumerate(prompts)}
        for alpha in ALPHAS:
            runs.append((f"teacher_alpha{alpha:.2f}_async", "async", sv.TeacherForcedDrafter(reference, alpha,
                                                                                              shape.vocab)))
        runs.append((f"teacher_alpha{ALPHAS[-1]:.2f}_sync", "sync",
                     sv.TeacherForcedDrafter(reference, ALPHAS[-1], shape.vocab)))
        for name, loop, drafter in runs:
            spec.drafter = drafter
            row[name] = measure(core, switch, loop, prompts, s, ref, spec, policy(), off["tok_s"])
        spec.drafter, spec.policy = own_drafter, engine_policy
        res[b] = row
        print(f"spec_async B={b}: " + json.dumps(row), flush=True)
        path.write_text(json.dumps({**res, "partial": True}, indent=1, default=str))
    res["wall_s"] = time.perf_counter() - t0
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
