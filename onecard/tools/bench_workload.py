"""`onecard bench`'s default workload: coding-assistant conversations (onecard/data/bench/coding_assistant.json).

Contract: ``load_workload()`` reads the bundled file (scripts/build_bench_workload.py makes it): one long system
prompt shared by every request, and conversations that open with a source file and go on for several turns
(explain, edit, diff, tests), each turn resending the whole history — long shared prefixes, as an editor's
assistant sends them. ``fit_conversations(client, workload, model, max_model_len, output_len)`` trims each
conversation's source file (and, on very small contexts, the system prompt and the outputs) so that its last
turn — history with every earlier reply at its full ``max_tokens`` — fits ``max_model_len``; prompt tokens are
counted by the server's ``/tokenize`` (chat ``messages``, template included). ``run_conversations`` sends the
turns in order within a conversation (the next turn carries the reply the server actually streamed) and runs
up to ``concurrency`` conversations at once; each turn is one streaming chat request measured by
``bench_request.send_request``.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import httpx
from tqdm import tqdm

TEMPLATE_SLACK = 8          # tokens per message the chat template adds that /tokenize of parts may not see


@dataclass(slots=True)
class Conversation:
    name: str
    system: str
    turns: list[str]        # user messages; the first holds the (trimmed) source file
    max_tokens: list[int]


def load_workload() -> dict[str, Any]:
    text = resources.files("onecard").joinpath("data/bench/coding_assistant.json").read_text()
    return json.loads(text)


async def count_tokens(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]]) -> int:
    r = await client.post("/tokenize", json={"model": model, "messages": messages})
    if r.status_code != 200 or "count" not in r.json():
        raise RuntimeError(f"/tokenize (chat messages) failed: {r.status_code} {r.text[:200]}; the coding "
                           "workload needs it to fit conversations to max_model_len (use --dataset-name random)")
    return int(r.json()["count"])


async def _fit_one(client: httpx.AsyncClient, model: str, conv: dict[str, Any], system: str,
                   max_model_len: int, output_len: int | None) -> Conversation:
    outs = [min(t["max_tokens"], output_len) if output_len else t["max_tokens"] for t in conv["turns"]]
    later = [t["user"] for t in conv["turns"][1:]]
    code_lines = conv["code"].splitlines()
    first_tpl = conv["turns"][0]["user"]
    placeholder = [{"role": "assistant", "content": "x"}]

    async def total(n_lines: int, sys_text: str, outs_: list[int]) -> int:
        first = first_tpl.replace("{code}", "\n".join(code_lines[:n_lines]))
        msgs = [{"role": "system", "content": sys_text}, {"role": "user", "content": first}]
        for u in later:
            msgs += placeholder + [{"role": "user", "content": u}]
        # Earlier replies are counted at their full max_tokens; the last turn's output on top.
        return await count_tokens(client, model, msgs) + sum(outs_) + TEMPLATE_SLACK * len(msgs)

    sys_text = system
    if await total(0, sys_text, outs) > max_model_len:
        # A small context (a test model): shorten the system prompt, then scale the outputs down.
        words = system.split()
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if await total(0, " ".join(words[:mid]), outs) <= max_model_len:
                lo = mid
            else:
                hi = mid - 1
        sys_text = " ".join(words[:lo])
        spare = max_model_len - await total(0, sys_text, [0] * len(outs))
        if spare < len(outs):
            raise RuntimeError(f"max_model_len={max_model_len} is too small for the coding workload's "
                               f"{len(outs)}-turn conversations; use --dataset-name random")
        scale = spare / sum(outs)
        outs = [max(1, math.floor(o * scale)) for o in outs]
    lo, hi = 0, len(code_lines)
    while lo < hi:                               # the most source lines that fit
        mid = (lo + hi + 1) // 2
        if await total(mid, sys_text, outs) <= max_model_len:
            lo = mid
        else:
            hi = mid - 1
    first = first_tpl.replace("{code}", "\n".join(code_lines[:lo]))
    return Conversation(conv["name"], sys_text, [first, *later], outs)


async def fit_conversations(client: httpx.AsyncClient, workload: dict[str, Any], model: str, max_model_len: int,
                            output_len: int | None = None) -> list[Conversation]:
    return list(await asyncio.gather(*(_fit_one(client, model, c, workload["system"], max_model_len, output_len)
                                       for c in workload["conversations"])))


async def run_conversations(client: httpx.AsyncClient, convs: list[Conversation], a: Any, model: str,
                            num_prompts: int) -> tuple[list[Any], float]:
    """Up to ``num_prompts`` turns, conversation-major; ``a.concurrency`` conversations in flight."""
    from onecard.tools.bench_request import RequestSpec, send_request

    # Turn budget per conversation: the first `num_prompts` turns in round-robin order.
    budget = [0] * len(convs)
    order = [(t, c) for t in range(max(len(c.turns) for c in convs)) for c in range(len(convs))]
    for t, c in order[:num_prompts]:
        if t < len(convs[c].turns):
            budget[c] += 1
    sem = asyncio.Semaphore(a.concurrency or len(convs))
    bar = tqdm(total=sum(budget), disable=a.disable_tqdm, desc="turns", file=sys.stderr)
    results: list[Any] = []
    index = iter(range(sum(budget)))
    t_zero = time.perf_counter()

    async def one(conv: Conversation, turns: int) -> None:
        async with sem:
            msgs = [{"role": "system", "content": conv.system}]
            for user, max_tokens in zip(conv.turns[:turns], conv.max_tokens[:turns]):
                msgs.append({"role": "user", "content": user})
                spec = RequestSpec(next(index), "", 0, max_tokens, 0, messages=list(msgs))
                r = await send_request(client, spec, a, model, t_zero)
                r.prompt_len = r.fitted_len = r.prompt_tokens
                results.append(r)
                bar.update(1)
                if not r.success:
                    return                      # the history would be wrong from here on
                msgs.append({"role": "assistant", "content": r.generated_text})

    await asyncio.gather(*(one(c, n) for c, n in zip(convs, budget) if n))
    duration = time.perf_counter() - t_zero
    bar.close()
    return sorted(results, key=lambda r: r.index), duration
