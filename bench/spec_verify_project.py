"""Projected decode speed-up from a measured verify-step table and acceptance histograms (CPU, no torch).

Contract: ``load_acceptance(path) -> {method: {k: [c_0 .. c_k]}}`` reads bench/spec_acceptance.py's JSON
tolerantly: any list of >= 2 non-negative numbers is a histogram of accepted draft lengths (c_j = verify steps
that accepted j of k proposed tokens); its k is the nearest enclosing key or ``k`` field that is an integer with
k + 1 == len(list) (else len − 1), its method the nearest enclosing ``method`` field or non-numeric key that is
not a generic word. ``load_steps_by_draft_len(path)``: the per-draft-length split when the JSON has it (``steps_by_draft_len``).
``project(acceptance, table, batches, by_len=None) -> dict`` (``table`` None: acceptance only): per method and k, the mean accepted length
a_k = Σ j·c_j / Σ c_j, the truncated-geometric acceptance α = Σ j·c_j / (Σ j·c_j + Σ_{j<k} c_j), and per
batch B the projected speed-up (1 + a_k) · T(B, 1) / T(B, 1 + k) (every sequence drafting alike), plus the
best k per method and batch. Derived from measurements, not a measurement.
``analytic_markdown()``: the cost model's analytic prediction (no table) for H200 / H100 / V100: relative
verify cost at k = 1..8, batch 1 and 16, and the policy's choice at a few acceptance rates (BENCHMARKS.md).
Usage: python bench/spec_verify_project.py ACCEPTANCE.json SPEC_VERIFY.json [CARD]
       python bench/spec_verify_project.py analytic
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onecard.core.spec.cost import MeasuredTable

_GENERIC = {"histogram", "hist", "histograms", "counts", "accepted", "acceptance", "k", "per_k", "by_k", "methods",
            "results", "data", "accept_hist", "accepted_hist", "accepted_length_histogram"}


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.isdigit():
        return int(x)
    return None


def load_acceptance(path: str | Path) -> dict[str, dict[int, list[float]]]:
    data = json.loads(Path(path).read_text())
    found: dict[str, dict[int, list[float]]] = {}

    def walk(obj: Any, keys: list[Any], method: str | None, k: int | None) -> None:
        if isinstance(obj, dict):
            m = obj.get("method") if isinstance(obj.get("method"), str) else method
            kk = _int(obj.get("k")) if _int(obj.get("k")) is not None else k
            for key, v in obj.items():
                if key in ("method", "k") and not isinstance(v, (dict, list)):
                    continue
                walk(v, [*keys, key], m, kk)
        elif isinstance(obj, list) and len(obj) >= 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and x >= 0 for x in obj):
            ks = [_int(key) for key in reversed(keys)]
            k_here = next((x for x in ks if x is not None and x + 1 == len(obj)), None)
            if k_here is None:
                k_here = k if k is not None and k + 1 == len(obj) else len(obj) - 1
            name = method or next((str(key) for key in reversed(keys) if isinstance(key, str)
                                   and _int(key) is None and key.lower() not in _GENERIC), "draft")
            found.setdefault(name, {})[k_here] = [float(x) for x in obj]
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, keys, method, k) if isinstance(v, dict) else walk(v, [*keys, i], method, k)

    walk(data, [], None, None)
    if not found:
        raise ValueError(f"{path}: no acceptance histogram found (lists of counts of accepted draft lengths)")
    return found


def load_steps_by_draft_len(path: str | Path) -> dict[str, dict[int, dict[int, dict[int, float]]]]:
    """{method: {k: {d: {a: steps}}}} from records carrying ``method``, ``k`` and ``steps_by_draft_len`` (steps
    whose draft had d tokens and whose first a were accepted); {} when the file has none."""
    data = json.loads(Path(path).read_text())
    out: dict = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            sbl, m, k = obj.get("steps_by_draft_len"), obj.get("method"), _int(obj.get("k"))
            if isinstance(sbl, dict) and isinstance(m, str) and k is not None:
                out.setdefault(m, {})[k] = {int(d): {int(a): float(n) for a, n in row.items()} for d, row in sbl.items()}
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(data)
    return out


def project(acceptance: dict[str, dict[int, list[float]]], table: Any, batches,
            by_len: dict[str, dict[int, dict[int, dict[int, float]]]] | None = None) -> dict:
    """``table``: a MeasuredTable (cost.py) or its JSON dict (``step_s``); None: acceptance figures only.
    With ``by_len`` (load_steps_by_draft_len) for a (method, k), the speed-up counts each step at its own
    draft length d: Σ(a + 1) / Σ T(B, 1 + d) x T(B, 1) (a step without a draft is a plain decode step), and α
    comes from the steps that carried a draft; otherwise every step is taken as a k-token verify."""
    tab = table if isinstance(table, MeasuredTable) or table is None else MeasuredTable.from_json(table)
    out: dict = {"note": "derived: measured verify-step table x CPU-measured acceptance; not an end-to-end run",
                 "methods": {}, "best": {}, "alpha_at_max_k": {}}
    for method, per_k in acceptance.items():
        rows = {}
        for k, hist in sorted(per_k.items()):
            total = sum(hist)
            if total <= 0 or k < 1:
                continue
            acc = sum(j * c for j, c in enumerate(hist))
            a_k = acc / total
            fails = sum(hist[:k])
            alpha = acc / (acc + fails) if acc + fails > 0 else 0.0
            speedup = {b: (1 + a_k) * tab.interpolate(b, 1) / tab.interpolate(b, 1 + k)
                       for b in batches if tab is not None and b in tab.step_s}
            steps = (by_len or {}).get(method, {}).get(k)
            if steps:
                succ = sum(a * n for row in steps.values() for a, n in row.items())
                miss = sum(n for d, row in steps.items() for a, n in row.items() if 0 < d and a < d)
                alpha = succ / (succ + miss) if succ + miss > 0 else 0.0
                emitted = sum((a + 1) * n for row in steps.values() for a, n in row.items())
                speedup = {b: emitted * tab.interpolate(b, 1)
                           / sum(n * tab.interpolate(b, 1 + d) for d, row in steps.items() for n in row.values())
                           for b in batches if tab is not None and b in tab.step_s}
            rows[k] = {"steps": total, "mean_accepted": a_k, "alpha": alpha, "speedup": speedup,
                       "by_draft_len": bool(steps)}
        out["methods"][method] = rows
        if rows:
            out["alpha_at_max_k"][method] = rows[max(rows)]["alpha"]
        out["best"][method] = {b: max(((k, r["speedup"][b]) for k, r in rows.items() if b in r["speedup"]),
                                      key=lambda kv: kv[1], default=None) for b in batches}
    return out


def analytic_markdown(config: dict | None = None) -> str:
    from onecard.core.spec.cost import CostModel, ModelShape
    from onecard.core.spec.policy import SpecPolicy

    if config is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from full_size import CONFIG as config
    shape = ModelShape.from_hf_config(config)
    cards = ("H200", "H100", "V100")
    ks = range(1, 9)
    lines = ["| card | batch | T(k=0) ms | " + " | ".join(f"k={k}" for k in ks) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in ks) + " |"]
    for card in cards:
        m = CostModel.for_card(card, shape)
        for b in (1, 16):
            rel = " | ".join(f"{m.relative_cost(b, [k] * b):.2f}" for k in ks)
            lines.append(f"| {card} | {b} | {m.step_time(b, b) * 1e3:.2f} | {rel} |")
    lines += ["", "| card | batch | " + " | ".join(f"α={a}: k, speed-up" for a in (0.3, 0.5, 0.7, 0.9)) + " |",
              "| --- | ---: | " + " | ".join("---" for _ in range(4)) + " |"]
    for card in cards:
        m = CostModel.for_card(card, shape)
        for b in (1, 16):
            cells = []
            for a in (0.3, 0.5, 0.7, 0.9):
                p = SpecPolicy(8, m, prior_acceptance=a)
                ks_ = p.choose({f"r{i}": [0] * 8 for i in range(b)})
                kset = sorted(set(ks_.values()))
                k_txt = str(kset[0]) if len(kset) == 1 else f"{kset[0]}–{kset[-1]}"
                cells.append(f"{k_txt}, {p.last.speedup:.2f}×" if p.last.draft_tokens else "off")
            lines.append(f"| {card} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "analytic":
        print(analytic_markdown())
        sys.exit(0)
    verify = json.loads(Path(sys.argv[2]).read_text())
    card = sys.argv[3] if len(sys.argv) > 3 else next(iter(verify["cards"]))
    tab = verify["cards"][card]
    print(json.dumps(project(load_acceptance(sys.argv[1]), tab, [int(b) for b in tab["step_s"]],
                             load_steps_by_draft_len(sys.argv[1])), indent=1))
