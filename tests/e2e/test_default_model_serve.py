"""The README's main job: `onecard serve` with no model serves the bundled 4-bit tiny coder on this CPU.

/health turns 200 within 60 s, the card is `onecard-tiny-coder`, and a chat completion asking for a Python
function returns text (the official openai client, real server process, 127.0.0.1).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai

from tests.e2e.harness import free_port, wait_health

ROOT = Path(__file__).resolve().parents[2]


def test_serve_with_no_model_serves_the_bundled_coder(tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "onecard.cli", "serve", "--host=127.0.0.1", f"--port={port}",
                             "--device=cpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_health(f"http://127.0.0.1:{port}", 200, timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["onecard-tiny-coder"]
        r = client.chat.completions.create(
            model="onecard-tiny-coder", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "Write a Python function that reverses a string."}])
        text = r.choices[0].message.content or ""
        assert len(text.strip()) > 0
        assert r.usage.completion_tokens > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.seek(0)
        print(log.read()[-2000:])
