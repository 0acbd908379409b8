"""Run a real uvicorn server on 127.0.0.1 (a free port) in a background thread, for e2e tests."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from onecard.config import CacheConfig, EngineConfig, Env, ModelConfig, SchedulerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scripted_engine_config(tokenizer_dir: Path, tokenizer, *, names=("coder", "reasoning"), max_model_len=256,
                           max_num_queued_reqs=None, max_num_seqs=8) -> EngineConfig:
    """An EngineConfig for the scripted runner (no weights): the tokenizer's EOS ends replies."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = ModelConfig(model=str(tokenizer_dir), path=Path(tokenizer_dir), hf_config={"num_hidden_layers": 1,
                        "num_attention_heads": 1, "hidden_size": 8}, architecture="Qwen3ForCausalLM",
                        dtype="float32", quant=None, max_model_len=max_model_len, seed=0,
                        tokenizer=str(tokenizer_dir), served_model_names=list(names),
                        generation_config={"eos_token_id": eos})
    return EngineConfig(model=model, cache=CacheConfig(block_size=16),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                                  max_model_len=max_model_len,
                                                  max_num_queued_reqs=max_num_queued_reqs),
                        device="cpu", enforce_eager=True, env=Env.read())


@dataclass
class RunningServer:
    url: str
    server: object
    thread: threading.Thread
    state: object

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(state, *, wait_ready: bool = True, timeout: float = 60.0) -> RunningServer:
    import uvicorn

    from onecard.server.app import build_app

    port = free_port()
    app = build_app(state)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    running = RunningServer(url, server, thread, state)
    if wait_ready:
        wait_health(url, 200, timeout)
    return running


def wait_health(url: str, status: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            last = None
        if last == status:
            return
        time.sleep(0.02)
    raise AssertionError(f"/health did not reach {status} (last {last})")


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples in /metrics (all label sets)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise KeyError(name)
    return total


def collect_chat_stream(stream):
    """Fold an OpenAI chat-completions stream (the official client's chunks) into (content, reasoning, calls by
    index {"id", "name", "arguments"}, finish_reason), checking OpenAI's protocol on the way."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        extra = d.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning += extra["reasoning_content"]
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                # the first delta of a call carries id, type and name, and arguments ""
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        if ch.finish_reason:
            finish = ch.finish_reason
    return content, reasoning, calls, finish
