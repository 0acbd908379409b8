"""`onecard verify URL [--api-key K] [--model NAME ...] [--json]`: the deployment smoke test, as a command.

Contract: ``main(argv) -> int``. It runs these checks against an OpenAI-compatible server, in order, and
keeps going after a failure so one run shows everything that is wrong:
  1. ``GET /v1/models``: 200 and a model list; prints ``GET /v1/models -> id=…, root=…`` per card;
  2. per name (``--model``, repeatable; default every served id): ``model NAME listed`` (it is in the list)
     and ``POST /v1/chat/completions model=NAME``: 200 with a choice and at least one completion token;
     prints the status, the latency and the first line of the reply;
  3. ``GET /health``: 200.
Exit status 0 when every check passed, 1 naming each failed check (``FAILED: <check>: <why>``), 2 on usage
errors. ``--json`` prints one JSON object (``ok``, ``checks``, ``models``) instead of the lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

DEFAULT_PROMPT = "Write a tiny Python program that prints the first ten Fibonacci numbers. Reply with code only."


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""
    status: int | None = None
    seconds: float | None = None


@dataclass(slots=True)
class Report:
    url: str
    checks: list[Check] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onecard verify", description=(
        "Smoke-test an OpenAI-compatible server: /v1/models, one chat completion per served name, /health."))
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer K`")
    p.add_argument("--model", action="append", default=None, metavar="NAME",
                   help="a served name to check (repeatable); default: every id in /v1/models")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message sent to each model")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per HTTP request")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return p


def _error_text(resp: httpx.Response) -> str:
    """vLLM's error body is {"error": {"message", "type", ...}}; fall back to the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return f"{err.get('type', '')}: {err.get('message', '')}".strip(": ")
    if isinstance(err, str):
        return err
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:300]
    return resp.text[:300]


def _first_line(message: dict[str, Any]) -> str:
    content = message.get("content")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if content and content.strip():
        text = content
    elif message.get("tool_calls"):
        return "(tool call) " + json.dumps(message["tool_calls"][0].get("function", {}))[:120]
    elif reasoning and reasoning.strip():
        text = "(reasoning) " + reasoning
    else:
        return "(empty reply)"
    return next(line for line in text.strip().splitlines() if line.strip())[:160]


def check_models(client: httpx.Client, report: Report, say) -> list[str]:
    name = "GET /v1/models"
    try:
        t0 = time.perf_counter()
        resp = client.get("/v1/models")
        dt = time.perf_counter() - t0
    except httpx.HTTPError as e:
        report.checks.append(Check(name, False, f"{type(e).__name__}: {e}"))
        return []
    if resp.status_code != 200:
        detail = f"{resp.status_code} {_error_text(resp)}"
        report.checks.append(Check(name, False, detail, resp.status_code, dt))
        say(f"{name} -> {detail}")
        return []
    try:
        cards = resp.json()["data"]
        ids = [str(c["id"]) for c in cards]
    except (ValueError, KeyError, TypeError) as e:
        report.checks.append(Check(name, False, f"not a model list: {e!r}", 200, dt))
        return []
    if not ids:
        report.checks.append(Check(name, False, "the model list is empty", 200, dt))
        return []
    report.models = cards
    for c in cards:
        say(f"{name} -> id={c['id']}, root={c.get('root')}")
    report.checks.append(Check(name, True, ", ".join(ids), 200, dt))
    return ids


def check_chat(client: httpx.Client, report: Report, model: str, args: argparse.Namespace, say) -> None:
    name = f"POST /v1/chat/completions model={model}"
    body = {"model": model, "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens, "temperature": 0.0, "stream": False}
    try:
        t0 = time.perf_counter()
        resp = client.post("/v1/chat/completions", json=body)
        dt = time.perf_counter() - t0
    except httpx.HTTPError as e:
        report.checks.append(Check(name, False, f"{type(e).__name__}: {e}"))
        say(f"{name} -> {type(e).__name__}")
        return
    if resp.status_code != 200:
        detail = f"{resp.status_code} {_error_text(resp)}"
        report.checks.append(Check(name, False, detail, resp.status_code, dt))
        say(f"{name} -> {detail}")
        return
    try:
        data = resp.json()
        message = data["choices"][0]["message"]
        completion_tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        report.checks.append(Check(name, False, f"200 but not a chat completion: {e!r}", 200, dt))
        say(f"{name} -> 200 but not a chat completion")
        return
    line = _first_line(message)
    if completion_tokens < 1:
        report.checks.append(Check(name, False, "200 but usage.completion_tokens is 0", 200, dt))
    else:
        report.checks.append(Check(name, True, line, 200, dt))
    say(f"{name} -> 200 in {dt:.2f}s: {line}")


def check_health(client: httpx.Client, report: Report, say) -> None:
    name = "GET /health"
    try:
        t0 = time.perf_counter()
        resp = client.get("/health")
        dt = time.perf_counter() - t0
    except httpx.HTTPError as e:
        report.checks.append(Check(name, False, f"{type(e).__name__}: {e}"))
        return
    ok = resp.status_code == 200
    report.checks.append(Check(name, ok, "" if ok else _error_text(resp), resp.status_code, dt))
    say(f"{name} -> {resp.status_code}")


def run_checks(args: argparse.Namespace, say) -> Report:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report = Report(url=args.url)
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout) as client:
        served = check_models(client, report, say)
        for model in args.model or served:
            if served and model not in served:
                report.checks.append(Check(
                    f"model {model} listed", False, f"not in /v1/models (served: {', '.join(served)})"))
            elif served:
                report.checks.append(Check(f"model {model} listed", True))
            # Chat even when unlisted: the server's own error is the most useful diagnosis.
            check_chat(client, report, model, args, say)
        check_health(client, report, say)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    report = run_checks(args, say)
    if args.json:
        print(json.dumps({"ok": report.ok, "url": report.url, "checks": [asdict(c) for c in report.checks],
                          "models": report.models}, indent=2))
    else:
        for c in report.failed():
            print(f"FAILED: {c.name}: {c.detail}", file=sys.stdout)
        n = len(report.checks)
        print(f"OK: {n} checks passed" if report.ok else f"{len(report.failed())} of {n} checks failed")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
