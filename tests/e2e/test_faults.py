"""Faults against a real server process whose engine core is a real spawned process (scripted runner):
the engine killed with SIGKILL while idle and mid-stream (streams end with an error naming it, /health turns
503 within 2 s, the server exits non-zero within 10 s), and SIGTERM with streams that outlive
--shutdown-timeout (they end with an error event and [DONE], exit 0, no traceback in the log)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import free_port, metric, wait_health

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "coder", "messages": [{"role": "user", "content": "go"}], "max_tokens": 900, "ignore_eos": True}


class _Proc:
    def __init__(self, tokenizer_dir: Path, tmp_path: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.fault_server", str(tokenizer_dir), str(self.port), *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def text(self) -> str:
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        m = re.search(r"engine core process started \(pid (\d+)\)", self.text())
        assert m, self.text()
        return int(m.group(1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def proc_factory(e2e_tokenizer_dir, tmp_path):
    made: list[_Proc] = []

    def make(*args: str) -> _Proc:
        p = _Proc(e2e_tokenizer_dir, tmp_path, *args)
        made.append(p)
        wait_health(p.url, 200, timeout=120)
        return p

    yield make
    for p in made:
        p.close()


def _health_503_within(url: str, seconds: float) -> float:
    """Seconds until /health answered 503 (asserts it happened within ``seconds``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 503:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"/health did not answer 503 within {seconds} s")


def _sse_events(r: httpx.Response, on_event=None) -> list[str]:
    events = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
            if on_event is not None:
                on_event(len(events))
    return events


def test_engine_killed_while_idle(proc_factory):
    p = proc_factory()
    os.kill(p.engine_pid(), signal.SIGKILL)
    detect = _health_503_within(p.url, 2.0)
    assert p.proc.wait(timeout=10) != 0
    text = p.text()
    print(f"engine death seen by /health after {detect:.3f} s")
    assert "the engine core died" in text and "SIGKILL" in text
    assert "Traceback" not in text


def test_engine_killed_mid_stream(proc_factory):
    p = proc_factory("--step-delay=0.02")
    pid = p.engine_pid()
    killed = threading.Event()
    plain: dict = {}

    def non_streaming() -> None:       # a concurrent non-streaming request in flight when the engine dies
        try:
            plain["r"] = httpx.post(p.url + "/v1/chat/completions", json=CHAT, timeout=60)
        except httpx.HTTPError as e:
            plain["error"] = e

    t = threading.Thread(target=non_streaming)
    t.start()

    killed_at = []

    def kill_after_a_few(count: int) -> None:
        # kill once the stream has a few events and both requests are inside the engine (no timing guess)
        if count >= 5 and not killed.is_set() and metric(p.url, "vllm:num_requests_running") == 2:
            killed.set()
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

    with httpx.stream("POST", p.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = _sse_events(r, kill_after_a_few)
    assert killed.is_set()
    print(f"engine death ended the stream {time.monotonic() - killed_at[0]:.3f} s after the kill")
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and "EngineDeadError" in err["message"] and "SIGKILL" in err["message"]
    t.join(timeout=30)
    assert "r" in plain, plain
    assert plain["r"].status_code == 500
    assert "EngineDeadError" in plain["r"].json()["error"]["message"]
    # a request after the death: refused at once, naming it (or the port is already closed)
    try:
        late = httpx.post(p.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert late.status_code in (500, 503), late.text
    except httpx.HTTPError:
        pass
    assert p.proc.wait(timeout=10) != 0
    assert "Traceback" not in p.text()


def test_sigterm_ends_streams_that_outlive_the_shutdown_timeout(proc_factory):
    p = proc_factory("--step-delay=0.02", "--shutdown-timeout=1")
    events: list[str] = []

    def signal_after_a_few(count: int) -> None:
        if count == 3:
            p.proc.send_signal(signal.SIGTERM)

    with httpx.stream("POST", p.url + "/v1/completions",
                      json={"model": "coder", "prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        events = _sse_events(r, signal_after_a_few)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"]
    assert p.proc.wait(timeout=30) == 0
    text = p.text()
    assert "Traceback" not in text and "Cancel " not in text, text[-3000:]
