"""bench/ab_table.py: the switch A/B's markdown table reads both forms long_context.py writes (the scenario lines
of a log, the whole JSON), puts each policy's median, spread and ratio to the first policy in its scenario's
column, and says "no" where any scenario's greedy tokens differ from the first policy's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import ab_table


def _scenario(batch: int, ctx: int, figures: dict[str, tuple[float, bool]]) -> dict:
    return {"batch": batch, "context": ctx,
            "policies": {spec: {"tok_s": t, "tok_s_min": t - 1, "tok_s_max": t + 1, "tokens_equal_first_policy": eq}
                         for spec, (t, eq) in figures.items()}}


def test_table_from_a_log_and_from_the_json(tmp_path):
    rows = [_scenario(1, 512, {"fill": (400.0, True), "fill+moe_slices": (500.0, True)}),
            _scenario(16, 8192, {"fill": (1700.0, True), "fill+moe_slices": (1700.0, False)})]
    log = tmp_path / "switch_ab.log"
    log.write_text("=== switchab\n" + "\n".join(json.dumps(r) for r in rows) + "\nbs  1 ctx 512\n")
    whole = tmp_path / "long_context.json"
    whole.write_text(json.dumps({"scenarios": rows}))
    for path in (log, whole):
        lines = ab_table.table(ab_table.scenarios(str(path))).splitlines()
        assert lines[0] == "| policy | batch 1, 512 | batch 16, 8,192 | tokens equal |"
        assert lines[2] == "| `fill` | 400.0 (399.0–401.0) | 1,700.0 (1,699.0–1,701.0) | yes |"
        assert lines[3] == ("| `fill+moe_slices` | 500.0 (499.0–501.0, 1.250×) | 1,700.0 (1,699.0–1,701.0, "
                            "1.000×) | **no** |")
    assert ab_table.table([]) == "(no scenario finished)"
