"""`onecard serve` as a real process (engine core in its own process, the default): start-up logs, SIGTERM
during a stream lets it finish, exit status 0; an engine that fails to start ends the server with status 1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.harness import free_port, wait_health

ROOT = Path(__file__).resolve().parents[2]


def test_serve_process_sigterm_finishes_in_flight_and_exits_0(tiny_moe_gptq_dir, tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "onecard.cli", "serve", str(tiny_moe_gptq_dir), "--served-model-name", "coder",
         "reasoning", "--host=127.0.0.1", f"--port={port}", "--max-model-len=256", "--device=cpu",
         "--reasoning-parser=qwen3", "--enable-auto-tool-choice", "--tool-call-parser=hermes",
         # Deterministic under load: the shutdown deadline is far beyond any stream here, so SIGTERM always
         # lets the stream finish (it failed when a loaded box made 150 tokens outlast 20 s); one engine
         # thread (the default on 2 cores) keeps the tiny model from collapsing under contention.
         "--shutdown-timeout=600", "--engine-threads=1", "--disable-log-stats"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_health(f"http://127.0.0.1:{port}", 200, timeout=120)
        body = {"model": "reasoning", "prompt": "def f(x):", "max_tokens": 60, "ignore_eos": True,
                "stream": True, "temperature": 0}
        got, done, finish = 0, False, None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    got += len(choices)
                    finish = finish or (choices[0]["finish_reason"] if choices else None)
                    if got == 1:
                        proc.send_signal(signal.SIGTERM)   # mid-stream: the stream must still complete
                elif line == "data: [DONE]":
                    done = True
        assert done and finish == "length"
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    print(text[-2500:])
    assert "served as coder, reasoning" in text
    for piece in ("dtype=float32", "quantization=gptq", "GiB; KV cache", "tokens", "max concurrency",
                  "ready in"):
        assert piece in text, (piece, text[-3000:])


def test_engine_start_failure_exits_1(e2e_tokenizer_dir):
    from onecard.server.launch import Server, make_state, settings_from
    from onecard.vocab import load_tokenizer
    from tests.e2e.harness import scripted_engine_config
    from tests.e2e.scripted import Script, ScriptedCoreClient

    tok = load_tokenizer(e2e_tokenizer_dir)
    config = scripted_engine_config(e2e_tokenizer_dir, tok)
    core = ScriptedCoreClient(config, Script(tok))

    def fail():
        raise RuntimeError("does not fit")

    core.runner.determine_num_blocks = fail
    server = Server(make_state(config, core, settings_from(config), tok), "127.0.0.1", free_port(),
                    log_level="warning")
    assert server.run() == 1
    assert "does not fit" in server.fatal
