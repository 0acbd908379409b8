"""`onecard verify` and `onecard bench` against a real onecard server on 127.0.0.1 (tiny checkpoint).

One server per module, serving the names `coder` and `reasoning` behind an API key. verify must pass and
print both names; it must fail naming the check for a name the server lacks and for a wrong key. bench must
finish a small run whose JSON has every figure, internally consistent, and write the PNG.
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from onecard.tools import bench_serve, verify

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
NAMES = ["coder", "reasoning"]
FIGURES = [f"{kind}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for kind in ("mean", "median", "p99")] + [
    "request_throughput", "output_throughput", "total_token_throughput", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(request) -> Path:
    for name in ("tiny_moe_gptq_dir", "tiny_dense_dir"):
        try:
            return Path(request.getfixturevalue(name))
        except pytest.FixtureLookupError:
            continue
    pytest.skip("no tiny checkpoint fixture (tests/conftest.py)")


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    model = _model_dir(request)
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "onecard.cli", "serve", str(model), "--served-model-name", *NAMES,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--api-key", API_KEY]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 180 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)             # polling a starting process; there is no event to wait on
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- verify
def test_verify_passes_and_prints_both_names(server):
    # Through the real command line, as an operator runs it.
    r = subprocess.run([sys.executable, "-m", "onecard.cli", "verify", server, "--api-key", API_KEY,
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    for name in NAMES:
        assert f"GET /v1/models -> id={name}, root=" in r.stdout
        assert f"POST /v1/chat/completions model={name} -> 200 in " in r.stdout
    assert "GET /health -> 200" in r.stdout and "FAILED" not in r.stdout


def test_verify_json(server, capsys):
    rc = verify.main([server, "--api-key", API_KEY, "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] is True
    assert [c["id"] for c in out["models"]] == NAMES
    chats = [c for c in out["checks"] if c["name"].startswith("POST /v1/chat/completions")]
    assert len(chats) == 2 and all(c["status"] == 200 and c["seconds"] > 0 for c in chats)


def test_verify_fails_naming_a_missing_model(server, capsys):
    rc = verify.main([server, "--api-key", API_KEY, "--model", "coder", "--model", "missing", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED: model missing listed" in out
    assert "FAILED: POST /v1/chat/completions model=missing: 404" in out
    assert "FAILED: POST /v1/chat/completions model=coder" not in out


def test_verify_fails_naming_a_wrong_api_key(server, capsys):
    rc = verify.main([server, "--api-key", "wrong", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED: GET /v1/models: 401" in out
    assert "GET /health -> 200" in out     # /health is open, as in vLLM: only the API check fails


def test_verify_fails_naming_an_unreachable_server(capsys):
    rc = verify.main([f"http://127.0.0.1:{_free_port()}", "--timeout", "5"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED: GET /v1/models: ConnectError" in out and "FAILED: GET /health" in out


# ---------------------------------------------------------------- bench
def _check_results(res: dict, n: int) -> None:
    for key in FIGURES:
        assert isinstance(res[key], (int, float)) and math.isfinite(res[key]), key
    reqs = res["requests"]
    assert res["completed"] == n and res["failed"] == 0 and len(reqs) == n
    for r in reqs:
        assert r["success"], r["error"]
        assert 0 < r["ttft_s"] <= r["e2el_s"], r
        assert r["output_tokens"] == r["output_len"], r          # ignore_eos makes the length exact
        # Prompts are fitted with the server's /tokenize: the usage it reports must agree, and the fit must
        # land on the requested length (one token of slack where a tokenizer allows no exact fit).
        assert r["prompt_tokens"] == r["fitted_len"], r
        assert abs(r["fitted_len"] - r["prompt_len"]) <= 1, r
        assert len(r["itl_s"]) <= r["output_tokens"] - 1
        assert r["ttft_s"] + sum(r["itl_s"]) <= r["e2el_s"] + 1e-6
        assert r["tpot_s"] == pytest.approx((r["e2el_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
        assert r["start_s"] + r["e2el_s"] <= res["duration"] + 1e-6
    # The aggregate figures are the per-request records', recomputed independently.
    ms = lambda xs: [1000 * x for x in xs]
    assert res["mean_ttft_ms"] == pytest.approx(statistics.fmean(ms(r["ttft_s"] for r in reqs)))
    assert res["median_e2el_ms"] == pytest.approx(statistics.median(ms(r["e2el_s"] for r in reqs)))
    assert res["mean_tpot_ms"] == pytest.approx(statistics.fmean(ms(r["tpot_s"] for r in reqs)))
    assert res["mean_itl_ms"] == pytest.approx(statistics.fmean(ms(x for r in reqs for x in r["itl_s"])))
    assert res["mean_ttft_ms"] <= res["p99_ttft_ms"] + 1e-9 and res["median_e2el_ms"] <= res["p99_e2el_ms"]
    assert res["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert res["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert res["request_throughput"] == pytest.approx(n / res["duration"])
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])


def test_bench_small_run(server, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = bench_serve.main([server, "--api-key", API_KEY, "--model", "coder", "--num-prompts", "6",
                           "--concurrency", "3", "--input-len", "16", "--output-len", "8",
                           "--json", str(out_json), "--plot", str(out_png), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(out_json.read_text())
    _check_results(res, 6)
    assert all(r["prompt_len"] == 16 and r["output_len"] == 8 for r in res["requests"])
    assert res["max_concurrency"] == 3 and res["model"] == "coder"
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms)" in printed
    import matplotlib.image

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(out_png)
    assert img.shape[0] > 100 and img.shape[1] > 100


def test_bench_request_rate_and_range(server, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = bench_serve.main([server, "--api-key", API_KEY, "--num-prompts", "4", "--request-rate", "20",
                           "--input-len", "16", "--output-len", "6", "--range-ratio", "0.5", "--seed", "3",
                           "--json", str(out_json), "--disable-tqdm", "--skip-initial-test"])
    assert rc == 0, capsys.readouterr().out
    res = json.loads(out_json.read_text())
    _check_results(res, 4)
    assert res["model"] == NAMES[0] and res["request_rate"] == 20
    for r in res["requests"]:
        assert 3 <= r["output_len"] <= 9 and 8 <= r["prompt_len"] <= 24    # [L(1-X), L(1+X)]
    assert len({r["prompt_len"] for r in res["requests"]}) > 1            # lengths were drawn, not fixed


def test_bench_fails_on_a_wrong_key(server, capsys):
    rc = bench_serve.main([server, "--api-key", "wrong", "--model", "coder", "--num-prompts", "2",
                           "--input-len", "4", "--output-len", "2", "--disable-tqdm"])
    assert rc == 1
    assert "401" in capsys.readouterr().err
