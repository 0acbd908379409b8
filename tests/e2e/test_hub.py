"""Hub ids against a real local hub (tests/hub_server.py, an HTTP server on 127.0.0.1 that HF_ENDPOINT points
to) through the real huggingface_hub: `onecard plan` reads < 1% of a 16.9 GB checkpoint and prints the plan the
local directory gives; `onecard serve` downloads the bundled model once and restarts offline from the cache; a
download cut mid-file resumes where it stopped; 404 / 401 / gated 403 / bad revision / offline / unreachable
each give one message naming the repo, the reason and `hf download`."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from onecard.config import Env
from onecard.hub.download import HubError, check_free_space
from onecard.hub.resolve import resolve_model
from tests.e2e.harness import free_port, wait_health
from tests.hub_server import LocalHub, Repo
from tests.unit._sparse_ckpt import qwen3_coder_30b

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "onecard" / "data" / "onecard-tiny-coder"


def _env(hub: LocalHub | str, cache: Path, token: str | None = None, offline: bool = False) -> Env:
    env = Env.read()
    env.hf_endpoint = hub if isinstance(hub, str) else hub.url
    env.hf_hub_cache, env.hf_home, env.hf_token, env.hf_hub_offline = str(cache), None, token, offline
    return env


def _proc_env(hub_url: str, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return {**env, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1", **extra}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_plan_from_remote_metadata_reads_under_one_percent(tmp_path):
    ckpt = qwen3_coder_30b(tmp_path / "coder")        # sparse shards: 16.9 GB described, holes on disk
    total = sum(p.stat().st_size for p in ckpt.iterdir())
    flags = ["--gpu", "V100-32GB", "--max-model-len", "65536", "--max-num-seqs", "16", "--json"]
    with LocalHub() as hub:
        hub.add(Repo("ModelCloud/Coder-GPTQ", ckpt, hash_files=False))
        remote = subprocess.run([sys.executable, "-m", "onecard.cli", "plan", "ModelCloud/Coder-GPTQ", *flags],
                                cwd=ROOT, env=_proc_env(hub.url, tmp_path / "cache"), capture_output=True,
                                text=True, timeout=300)
        served = hub.served()
    local = subprocess.run([sys.executable, "-m", "onecard.cli", "plan", str(ckpt), *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert remote.returncode == local.returncode == 0, remote.stderr[-3000:] + local.stderr[-2000:]
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got.pop("model") == "ModelCloud/Coder-GPTQ"
    for key in ("model", "host_memory_available_gib"):     # the path as given; a reading of this machine now
        want.pop(key, None)
        got.pop(key, None)
    assert got == want                                   # the same plan as from the files on disk
    assert total > 16e9 and 0 < served < 0.01 * total, (served, total)
    # Nothing was downloaded into the cache: no shard there.
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


def test_serve_downloads_once_then_starts_offline_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    size = sum(p.stat().st_size for p in TINY.iterdir())

    def serve_and_chat(env: dict[str, str], log: Path) -> str:
        port = free_port()
        with log.open("w+") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "onecard.cli", "serve", "onecard/tiny-coder", "--host=127.0.0.1",
                 f"--port={port}", "--max-model-len=256", "--device=cpu", "--served-model-name", "coder"],
                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
            try:
                wait_health(f"http://127.0.0.1:{port}", 200, timeout=240)
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                               json={"model": "coder", "prompt": "def add(a, b):", "max_tokens": 8})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            finally:
                proc.terminate()
                proc.wait(timeout=60)

    with LocalHub() as hub:
        hub.add(Repo("onecard/tiny-coder", TINY))
        first = serve_and_chat(_proc_env(hub.url, cache), tmp_path / "serve1.log")
        assert hub.served() == size                      # every file once, no byte twice
        hub_url = hub.url
    log1 = (tmp_path / "serve1.log").read_text()
    assert "downloading onecard/tiny-coder" in log1 and "downloaded onecard/tiny-coder" in log1
    # The hub is gone; offline, the second start reads the cache only.
    second = serve_and_chat(_proc_env(hub_url, cache, HF_HUB_OFFLINE="1"), tmp_path / "serve2.log")
    assert "downloading" not in (tmp_path / "serve2.log").read_text()
    assert first == second
    (snap,) = (cache / "models--onecard--tiny-coder" / "snapshots").iterdir()
    assert _sha256(snap / "model.safetensors") == _sha256(TINY / "model.safetensors")


def test_download_cut_mid_file_resumes(tmp_path):
    """A connection cut mid-file: huggingface_hub asks for the rest with a ranged GET (from the last whole
    DOWNLOAD_CHUNK_SIZE written), in the same start. After an outage that outlasts its retries, the next start
    keeps every file that had completed (huggingface_hub >= 1.x deletes a partial file; see the README)."""
    from huggingface_hub import constants

    cache = tmp_path / "cache"
    weights, size = TINY / "model.safetensors", (TINY / "model.safetensors").stat().st_size
    cut = 12 << 20
    resumed_at = cut // constants.DOWNLOAD_CHUNK_SIZE * constants.DOWNLOAD_CHUNK_SIZE
    assert 0 < resumed_at < size
    key = ("onecard/tiny-coder", "model.safetensors")
    with LocalHub() as hub:
        hub.add(Repo("onecard/tiny-coder", TINY))
        hub.cut_after["model.safetensors"] = cut
        path = resolve_model("onecard/tiny-coder", _env(hub, cache))
        ranges = [rng for method, p, rng in hub.requests if method == "GET" and p.endswith("/model.safetensors")]
        assert ranges == [None, f"bytes={resumed_at}-"], ranges
        assert hub.bytes_sent[key] == cut + size - resumed_at
        assert _sha256(path / "model.safetensors") == _sha256(weights)

    with LocalHub() as hub:
        hub.add(Repo("onecard/tiny-coder", TINY))
        hub.cut_after["model.safetensors"] = cut
        hub.down_after_cut = True                       # the connection drops, then the hub stays down
        with pytest.raises(HubError) as ei:
            resolve_model("onecard/tiny-coder", _env(hub, tmp_path / "cache2"))
        msg = str(ei.value)
        assert "onecard/tiny-coder" in msg and "cannot be reached" in msg and "hf download" in msg, msg
        before = dict(hub.bytes_sent)
        hub.down = False
        path = resolve_model("onecard/tiny-coder", _env(hub, tmp_path / "cache2"))
        again = {k: n - before.get(k, 0) for k, n in hub.bytes_sent.items() if n - before.get(k, 0)}
        assert again == {key: size}, again               # only the file that was cut is fetched again
    assert _sha256(path / "model.safetensors") == _sha256(weights)


def test_errors_name_the_repo_the_reason_and_hf_download(tmp_path):
    with LocalHub() as hub:
        hub.add(Repo("org/private", TINY, token="hf_secret"))
        hub.add(Repo("org/gated", TINY, token="hf_secret", gated=True))
        cases = {
            ("org/missing", None, None): "does not exist or is private (401)",
            ("org/missing", "hf_secret", None): "does not exist on",
            ("org/private", None, None): "does not exist or is private (401)",
            ("org/gated", None, None): "gated repo (403)",
            ("org/private", "hf_secret", "v9"): "revision 'v9' does not exist",
        }
        for (repo, token, rev), reason in cases.items():
            with pytest.raises(HubError) as ei:
                resolve_model(repo, _env(hub, tmp_path / "c1", token=token), revision=rev)
            msg = str(ei.value)
            assert repo in msg and reason in msg and f"`hf download {repo}" in msg, msg
        # With the token, the private repo downloads, at a pinned commit too (ORG/NAME@REV).
        sha = hub.repos["org/private"].sha
        path = resolve_model(f"org/private@{sha}", _env(hub, tmp_path / "c2", token="hf_secret"))
        assert path.name == sha and (path / "model.safetensors").exists()
        with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
            resolve_model("org/private", _env(hub, tmp_path / "c3", token="hf_secret", offline=True))
        assert hub.served("org/private") == sum(p.stat().st_size for p in TINY.iterdir())
    with pytest.raises(HubError, match=r"org/private.*cannot be reached.*hf download org/private"):
        resolve_model("org/private", _env(f"http://127.0.0.1:{free_port()}", tmp_path / "c4"))  # nothing listens
    # The cached copy still resolves offline, with no hub at all.
    assert resolve_model(f"org/private@{sha}", _env(hub.url, tmp_path / "c2", offline=True)) == path


def test_disk_space_is_checked_before_downloading(tmp_path):
    check_free_space("org/m", None, need=10, cache_dir=tmp_path / "a" / "b", free=11)
    with pytest.raises(HubError, match=r"org/m.*too full.*needs 16\.90 GB and 1\.00 GB is free.*hf download"):
        check_free_space("org/m", None, need=16_900_000_000, cache_dir=tmp_path, free=1_000_000_000)
