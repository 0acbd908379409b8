"""One streamed request of the serving benchmark and its measurement (``onecard bench``'s client side).

Contract: ``RequestSpec`` (what to send: a prompt or a chat history, its token lengths), ``RequestResult`` (what
came back: TTFT, inter-token latencies, end-to-end latency, usage, text, error), ``send_request(client, spec, a,
model, t_zero)``: POSTs ``spec`` to ``a.endpoint`` as a streaming OpenAI request (``max_tokens`` = the output
length, ``ignore_eos``, usage in the stream) and times each token-carrying chunk. Shared by the random-prompt
benchmark (``bench_serve``) and the bundled coding workload (``bench_workload``), which import it and not each
other.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class RequestSpec:
    index: int
    prompt: str
    prompt_len: int          # tokens asked for
    output_len: int
    measured_len: int        # tokens in `prompt` as the server counts them (== prompt_len when fitted exactly)
    messages: list[dict[str, str]] | None = None     # a chat history (the coding workload) instead of `prompt`


@dataclass(slots=True)
class RequestResult:
    index: int
    success: bool
    prompt_len: int          # requested input tokens
    output_len: int          # requested output tokens
    fitted_len: int = 0      # tokens in the prompt by the server's /tokenize (the closest to prompt_len found)
    prompt_tokens: int = 0   # usage.prompt_tokens as the server counted them
    output_tokens: int = 0   # usage.completion_tokens (else the number of streamed token chunks)
    start_s: float = 0.0     # send time, seconds after the benchmark started
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ---------------------------------------------------------------- requests
def _request_body(spec: RequestSpec, a: argparse.Namespace, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": a.temperature}
    if spec.messages is not None:
        body["messages"] = spec.messages
    elif a.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def _text_of(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _has_token(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning", "reasoning_content", "tool_calls"))


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, a: argparse.Namespace, model: str,
                       t_zero: float) -> RequestResult:
    res = RequestResult(spec.index, False, spec.prompt_len, spec.output_len, fitted_len=spec.measured_len)
    st = time.perf_counter()
    res.start_s = st - t_zero
    ttft: float | None = None
    last = st
    chunks, usage = 0, None
    try:
        async with client.stream("POST", a.endpoint, json=_request_body(spec, a, model)) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices:
                    res.generated_text += _text_of(choices[0])
                if choices and _has_token(choices[0]):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - st
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2el_s = time.perf_counter() - st
    if ttft is None:
        res.error = "the stream carried no tokens"
        return res
    res.ttft_s = ttft
    res.prompt_tokens = int(usage["prompt_tokens"]) if usage else spec.measured_len
    res.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    res.success = True
    return res
