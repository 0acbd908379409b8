"""The markdown table of a switch A/B (bench/long_context.py's scenario lines, e.g. run_h200.sh switchab's
$OUT/switch_ab.log, or its --out JSON): one row per policy, one column per (batch x context) scenario, each cell
the median tok/s, its min-max over the runs and the ratio to the first policy; the last column says whether every
scenario's greedy tokens equal the first policy's.
Usage: python bench/ab_table.py switch_ab.log|long_context.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def scenarios(path: str) -> list[dict]:
    """The scenario dicts of a long_context.py output: JSON lines (a log) or the whole JSON (its "scenarios")."""
    text = Path(path).read_text()
    try:
        return json.loads(text)["scenarios"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no scenario finished)"
    specs = list(rows[0]["policies"])
    head = ["policy"] + [f"batch {r['batch']}, {r['context']:,}" for r in rows] + ["tokens equal"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for spec in specs:
        cells = [f"`{spec}`"]
        equal = True
        for r in rows:
            p = r["policies"].get(spec)
            if p is None:
                cells.append("—")
                continue
            base = r["policies"][specs[0]]["tok_s"]
            ratio = "" if spec == specs[0] else f", {p['tok_s'] / base:.3f}×"
            cells.append(f"{p['tok_s']:,.1f} ({p['tok_s_min']:,.1f}–{p['tok_s_max']:,.1f}{ratio})")
            equal = equal and p["tokens_equal_first_policy"]
        cells.append("yes" if equal else "**no**")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(table(scenarios(sys.argv[1])))
