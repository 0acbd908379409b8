"""``onecard bench``'s speculative-decoding figures, from the server's /metrics before and after the run.

Contract: ``await read_spec_counters(client)`` -> the server's ``vllm:spec_decode_*`` counters (drafts, draft
tokens, accepted tokens, accepted per position) or None when it does not speculate (or /metrics is not there).
``spec_summary(before, after)`` -> vLLM bench serve's keys for the run's delta: ``spec_decode_acceptance_rate``
(%, accepted / draft tokens), ``spec_decode_acceptance_length`` (1 + accepted / drafts: tokens per verify step),
``spec_decode_num_drafts``, ``spec_decode_draft_tokens``, ``spec_decode_accepted_tokens``,
``spec_decode_per_position_acceptance_rates`` (accepted at each position / drafts).
"""
from __future__ import annotations

from typing import Any

_PREFIX = "vllm:spec_decode_"


async def read_spec_counters(client) -> dict[str, Any] | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
    except Exception:  # noqa: BLE001 - the figures are optional: no /metrics, no figures
        return None
    if r.status_code != 200:
        return None
    got: dict[str, Any] = {"per_pos": {}}
    for fam in text_string_to_metric_families(r.text):
        if not fam.name.startswith(_PREFIX):
            continue
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            key = s.name[len(_PREFIX):-len("_total")]
            if key == "num_accepted_tokens_per_pos":
                pos = int(s.labels.get("position", 0))
                got["per_pos"][pos] = got["per_pos"].get(pos, 0.0) + s.value
            else:
                got[key] = got.get(key, 0.0) + s.value
    return got if "num_drafts" in got else None


def spec_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    if after is None:
        return {}
    before = before or {"per_pos": {}}

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, draft_tokens, accepted = delta("num_drafts"), delta("num_draft_tokens"), delta("num_accepted_tokens")
    per_pos = [(after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts if drafts else 0.0
               for p in sorted(after["per_pos"])]
    return {"spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else 0.0,
            "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(draft_tokens),
            "spec_decode_accepted_tokens": int(accepted), "spec_decode_per_position_acceptance_rates": per_pos}
