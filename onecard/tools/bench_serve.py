"""`onecard bench URL`: a serving benchmark client (what `vllm bench serve` does), runnable with the URL alone.

Contract: ``main(argv) -> int``. With only a URL it takes the model (and its max_model_len) from ``/v1/models``
and runs the bundled coding-assistant workload (``--dataset-name coding``, ``bench_workload``: multi-turn chats
under one long system prompt, a source file per conversation, edit/diff/test requests; token counts from the
server's ``usage``). With ``--input-len``/``--output-len`` (``--dataset-name random``) it sends
``--num-prompts`` streaming requests to an OpenAI-compatible server,
either at most ``--concurrency`` at a time or arriving as a Poisson process at ``--request-rate`` per second,
with prompts of ``--input-len`` tokens and ``max_tokens=--output-len`` plus ``ignore_eos`` (a vLLM extra) so
outputs are exactly that long; ``--range-ratio X`` draws each length uniformly from [L(1-X), L(1+X)].
Prompt lengths are fitted with the server's ``/tokenize`` (else a ``max_tokens=1`` probe's usage). It reports
TTFT, TPOT, ITL and end-to-end latency (mean, median, std, p90, p99, in ms), request and token throughput;
``--json FILE`` writes those figures with the keys of `vllm bench serve`'s result file (``model_id``,
``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``generated_texts``, ``errors``, ``mean_ttft_ms`` ...)
plus one record per request (seconds); when the server speculates, the run's mean acceptance length and the
other ``spec_decode_*`` keys of `vllm bench serve` (from /metrics before and after; tools/bench_spec.py);
``--plot FILE.png`` draws latency against time and a TTFT histogram. Exit 0 when every request succeeded.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from onecard.tools.bench_request import RequestResult, RequestSpec, send_request
from onecard.tools.bench_spec import read_spec_counters, spec_summary

log = logging.getLogger(__name__)

# Short common words: most are one token with a leading space in BPE vocabularies, so a first guess of one
# word per token is close and /tokenize only has to correct it.
_WORD_TEXT = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
          "had by word but not what all were we when your can said there use an each which she do how their "
          "if will up other about out many then them these so some her would make like him into time has look "
          "two more write go see number no way could people my than first water been call who oil its now find "
          "long down day did get come made may part def return class import self print list dict value key "
          "data file line code test run loop int str true false none while break else try except yield")
_WORDS = _WORD_TEXT.split()




def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onecard bench", description=(
        "Benchmark an OpenAI-compatible server with random prompts of fixed or ranged length (streaming)."))
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served name to use; default: the first id in /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="with chat, --input-len counts the chat template's tokens too")
    p.add_argument("--dataset-name", choices=["coding", "random"], default=None,
                   help="coding: the bundled coding-assistant conversations (default without --input-len); "
                        "random: prompts of --input-len tokens")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (coding: turns, default all of them; random: required)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                      help="at most C requests in flight (default: no limit)")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="Poisson arrivals at R requests/s (default inf: all at once)")
    p.add_argument("--input-len", type=int, default=None, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=None,
                   help="random: output tokens; coding: a cap on each turn's max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-X), L(1+X)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="latency over time + TTFT histogram")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--skip-initial-test", action="store_true",
                   help="do not send one unmeasured request first (it checks the setup and warms up)")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.dataset_name is None:
        a.dataset_name = "random" if a.input_len is not None else "coding"
    if a.dataset_name == "random" and None in (a.num_prompts, a.input_len, a.output_len):
        p.error("--dataset-name random needs --num-prompts, --input-len and --output-len")
    if a.dataset_name == "coding":
        if a.input_len is not None:
            p.error("--input-len applies to --dataset-name random only")
        a.endpoint = "/v1/chat/completions"
    if any(v is not None and v < 1 for v in (a.num_prompts, a.input_len, a.output_len)):
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0.0 <= a.range_ratio < 1.0:
        p.error(f"--range-ratio={a.range_ratio} must be in [0, 1)")
    if a.concurrency is not None and a.concurrency < 1:
        p.error(f"--concurrency={a.concurrency} must be >= 1")
    if not a.request_rate > 0:
        p.error(f"--request-rate={a.request_rate} must be > 0")


# ---------------------------------------------------------------- prompts
def draw_lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class TokenCounter:
    """Counts prompt tokens as the server will: /tokenize, else a max_tokens=1 probe's usage, else words.

    For the chat endpoint it counts the whole templated conversation (vLLM's /tokenize takes `messages`), so
    --input-len is the prompt the model sees, template included."""

    def __init__(self, client: httpx.AsyncClient, model: str, endpoint: str) -> None:
        self.client, self.model, self.endpoint = client, model, endpoint
        self.chat = endpoint.endswith("chat/completions")
        self.method: str | None = None

    def _payload(self, text: str) -> dict[str, Any]:
        if self.chat:
            return {"model": self.model, "messages": [{"role": "user", "content": text}]}
        return {"model": self.model, "prompt": text}

    async def count(self, text: str) -> int:
        if self.method in (None, "tokenize"):
            r = await self.client.post("/tokenize", json=self._payload(text))
            if r.status_code == 200 and "count" in r.json():
                self.method = "tokenize"
                return int(r.json()["count"])
            if self.method == "tokenize":
                raise RuntimeError(f"/tokenize failed: {r.status_code} {r.text[:200]}")
            self.method = "probe"
            log.warning("/tokenize unavailable (%s); measuring prompts with max_tokens=1 probes", r.status_code)
        if self.method == "probe":
            r = await self.client.post(self.endpoint, json=self._payload(text) | {"max_tokens": 1})
            usage = r.json().get("usage") if r.status_code == 200 else None
            if usage and "prompt_tokens" in usage:
                return int(usage["prompt_tokens"])
            self.method = "words"
            log.warning("no way to count tokens on the server; assuming one token per word")
        return len(text.split())


async def fit_prompt(counter: TokenCounter, rng: random.Random, target: int) -> tuple[str, int]:
    """A random word sequence whose token count is `target`, or the closest found in a bounded search.

    Whole words first (a proportional correction), then character-level trimming or one-letter words, since a
    word can be several tokens in a small vocabulary."""
    words = [rng.choice(_WORDS) for _ in range(2 * target + 16)]
    n_words = target
    best: tuple[int, str, int] | None = None          # (distance, text, tokens)

    async def measure(text: str) -> int:
        nonlocal best
        n = await counter.count(text)
        if best is None or abs(n - target) < best[0]:
            best = (abs(n - target), text, n)
        return n

    for _ in range(6):
        n_words = max(1, min(n_words, len(words) - 1))
        n = await measure(" ".join(words[:n_words]))
        if n == target:
            return best[1], best[2]
        step = round(n_words * (target / n - 1)) if n else n_words
        n_words += step if step else (1 if n < target else -1)
    assert best is not None
    text, n = best[1], best[2]
    for _ in range(8):                                # fine steps from the best whole-word prompt
        if n == target or counter.method == "words":
            break
        if n > target:
            moves = [text[:-1].rstrip() or text]
        else:                                         # a letter glued on often adds one token, spaced two
            c = rng.choice("abcdefghijklmnopqrstuvwxyz")
            moves = [text + c, text + " " + c]
        for cand in moves:
            m = await measure(cand)
            if m == target:
                return cand, m
        text, n = cand, m
    return best[1], best[2]


async def build_specs(client: httpx.AsyncClient, a: argparse.Namespace, model: str) -> list[RequestSpec]:
    rng = random.Random(a.seed)
    in_lens = draw_lengths(rng, a.num_prompts, a.input_len, a.range_ratio)
    out_lens = draw_lengths(rng, a.num_prompts, a.output_len, a.range_ratio)
    counter = TokenCounter(client, model, a.endpoint)
    # One prompt first so the counting method is settled before the rest run concurrently.
    first = await fit_prompt(counter, random.Random(rng.random()), in_lens[0])
    sem = asyncio.Semaphore(8)

    async def one(seed: float, target: int) -> tuple[str, int]:
        async with sem:
            return await fit_prompt(counter, random.Random(seed), target)

    rest = await asyncio.gather(*(one(rng.random(), t) for t in in_lens[1:]))
    fitted = [first, *rest]
    if counter.method == "words":
        log.warning("prompt lengths are estimates (one token per word)")
    return [RequestSpec(i, text, t, o, n) for i, ((text, n), t, o) in enumerate(zip(fitted, in_lens, out_lens))]


def arrival_offsets(rng: random.Random, n: int, rate: float) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(client: httpx.AsyncClient, specs: list[RequestSpec], a: argparse.Namespace,
                   model: str) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(a.concurrency) if a.concurrency else None
    offsets = arrival_offsets(random.Random(a.seed + 1), len(specs), a.request_rate)
    bar = tqdm(total=len(specs), disable=a.disable_tqdm, desc="requests", file=sys.stderr)
    t_zero = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestResult:
        if sem is None:
            r = await send_request(client, spec, a, model, t_zero)
        else:
            async with sem:
                r = await send_request(client, spec, a, model, t_zero)
        bar.update(1)
        return r

    tasks = []
    for spec, off in zip(specs, offsets):
        wait = t_zero + off - time.perf_counter()
        if wait > 0:                       # the arrival schedule, not a delay for its own sake
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(spec)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t_zero
    bar.close()
    return list(results), duration


# ---------------------------------------------------------------- figures
def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    v = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    return {f"mean_{prefix}_ms": float(v.mean()), f"median_{prefix}_ms": float(np.median(v)),
            f"std_{prefix}_ms": float(v.std()), f"p90_{prefix}_ms": float(np.percentile(v, 90)),
            f"p99_{prefix}_ms": float(np.percentile(v, 99))}


def summarize(results: list[RequestResult], duration: float, a: argparse.Namespace, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if a.endpoint.endswith(
            "chat/completions") else "openai", "base_url": a.url, "endpoint": a.endpoint,
        "dataset_name": a.dataset_name, "model_id": model, "tokenizer_id": model, "model": model,
        "num_prompts": len(results), "burstiness": 1.0, "request_goodput": None,
        "request_rate": "inf" if math.isinf(a.request_rate) else a.request_rate,
        "max_concurrency": a.concurrency, "input_len": a.input_len, "output_len": a.output_len,
        "range_ratio": a.range_ratio, "seed": a.seed,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    out |= _stats("ttft", [r.ttft_s for r in ok])
    out |= _stats("tpot", [t for r in ok if (t := r.tpot_s) is not None])
    out |= _stats("itl", [x for r in ok for x in r.itl_s])
    out |= _stats("e2el", [r.e2el_s for r in ok])
    # vLLM's per-request lists (seconds), in request order.
    out["input_lens"] = [r.prompt_tokens for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["ttfts"] = [r.ttft_s for r in results]
    out["itls"] = [r.itl_s for r in results]
    out["generated_texts"] = [r.generated_text for r in results]
    out["errors"] = [r.error for r in results]
    out["requests"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in results]
    return out


def print_summary(s: dict[str, Any]) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Maximum request concurrency", s["max_concurrency"]), ("Request rate (req/s)", s["request_rate"]),
            ("Benchmark duration (s)", f"{s['duration']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", None))
        rows += [(f"{kind.capitalize()} {key.upper()} (ms)", f"{s[f'{kind}_{key}_ms']:.2f}")
                 for kind in ("mean", "median", "p99")]
    if "spec_decode_acceptance_length" in s:            # vLLM bench serve's section
        rows += [("-- Speculative Decoding --", None),
                 ("Acceptance rate (%)", f"{s['spec_decode_acceptance_rate']:.2f}"),
                 ("Acceptance length", f"{s['spec_decode_acceptance_length']:.2f}"),
                 ("Drafts", s["spec_decode_num_drafts"]), ("Draft tokens", s["spec_decode_draft_tokens"]),
                 ("Accepted tokens", s["spec_decode_accepted_tokens"])]
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for name, value in rows:
        print(f"{name:<40}{'' if value is None else value!s:>10}")
    print("=" * 50)


def write_plot(results: list[RequestResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")               # no display on servers and in CI
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    starts = [r.start_s for r in ok]
    ax1.scatter(starts, [r.e2el_s * 1e3 for r in ok], s=12, label="end-to-end")
    ax1.scatter(starts, [r.ttft_s * 1e3 for r in ok], s=12, label="TTFT")
    ax1.set(xlabel="request sent at (s after start)", ylabel="latency (ms)", title="Latency over time")
    ax1.legend()
    ax2.hist([r.ttft_s * 1e3 for r in ok], bins=min(50, max(5, len(ok) // 2)))
    ax2.set(xlabel="TTFT (ms)", ylabel="requests", title="TTFT histogram")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- entry point
async def _amain(a: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    timeout = httpx.Timeout(a.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.url.rstrip("/"), headers=headers, timeout=timeout,
                                 limits=limits) as client:
        r = await client.get("/v1/models")
        if r.status_code != 200:
            print(f"GET /v1/models failed: {r.status_code} {r.text[:200]}", file=sys.stderr)
            return 1
        cards = {c["id"]: c for c in r.json()["data"]}
        model = a.model or next(iter(cards))
        spec_before = await read_spec_counters(client)
        if a.dataset_name == "coding":
            from onecard.tools import bench_workload

            max_len = int((cards.get(model) or {}).get("max_model_len") or 8192)
            convs = await bench_workload.fit_conversations(client, bench_workload.load_workload(), model,
                                                           max_len, a.output_len)
            n = a.num_prompts or sum(len(c.turns) for c in convs)
            a.concurrency = a.concurrency or len(convs)
            results, duration = await bench_workload.run_conversations(client, convs, a, model, n)
            spec = spec_summary(spec_before, await read_spec_counters(client))
            return _report(results, duration, a, model, spec)
        specs = await build_specs(client, a, model)
        if not a.skip_initial_test:
            first = await send_request(client, specs[0], a, model, time.perf_counter())
            if not first.success:
                print(f"initial test request failed: {first.error}", file=sys.stderr)
                return 1
        results, duration = await run_load(client, specs, a, model)
        spec = spec_summary(spec_before, await read_spec_counters(client))
    return _report(results, duration, a, model, spec)


def _report(results: list[RequestResult], duration: float, a: argparse.Namespace, model: str,
            spec: dict[str, Any] | None = None) -> int:
    summary = summarize(results, duration, a, model) | (spec or {})
    print_summary(summary)
    errors = sorted({e for e in summary["errors"] if e})
    if errors:
        print("errors: " + "; ".join(errors[:5]), file=sys.stderr)
    if a.json_file:
        with open(a.json_file, "w") as f:
            json.dump(summary, f, indent=2)
    if a.plot:
        write_plot(results, a.plot)
    return 0 if summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    try:
        return asyncio.run(_amain(a))
    except httpx.HTTPError as e:
        print(f"onecard bench: cannot reach {a.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:                # the workload cannot be built against this server (named)
        print(f"onecard bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
