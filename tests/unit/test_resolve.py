"""onecard.hub.resolve: local directories and hub ids in a (fake, on-disk) HF cache, offline (HF_HUB_OFFLINE):
never the network. Downloads are tested against a local hub server in tests/e2e/test_hub.py."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from onecard.config import ConfigError, EngineArgs, Env
from onecard.hub.resolve import hub_cache_dirs, resolve_model


def _env(hub_cache: Path | None = None, hf_home: Path | None = None) -> Env:
    return Env(hf_home=None if hf_home is None else str(hf_home),
               hf_hub_cache=None if hub_cache is None else str(hub_cache), kernel_backend="ref",
               triton_interpret=False, cpu_kv_cache_bytes=1 << 20, log_level="INFO", hf_hub_offline=True)


def _snapshot(cache: Path, repo_id: str, rev: str, mtime: float | None = None) -> Path:
    snap = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (snap / "model.safetensors").write_bytes(b"")
    if mtime is not None:
        os.utime(snap, (mtime, mtime))
    return snap


def test_local_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), _env()) == tmp_path.resolve()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(empty), _env())


def test_hub_id_follows_refs_main(tmp_path):
    cache = tmp_path / "hub"
    old = _snapshot(cache, "Org/Model-A", "aaaa", mtime=time.time() - 100)
    _snapshot(cache, "Org/Model-A", "bbbb", mtime=time.time())
    (cache / "models--Org--Model-A" / "refs").mkdir()
    (cache / "models--Org--Model-A" / "refs" / "main").write_text("aaaa\n")
    assert resolve_model("Org/Model-A", _env(hub_cache=cache)) == old


def test_hub_id_newest_snapshot_without_ref(tmp_path):
    cache = tmp_path / "hub"
    _snapshot(cache, "Org/M", "old", mtime=time.time() - 100)
    new = _snapshot(cache, "Org/M", "new", mtime=time.time())
    assert resolve_model("Org/M", _env(hub_cache=cache)) == new


def test_hf_home_hub_is_searched(tmp_path):
    snap = _snapshot(tmp_path / "home" / "hub", "Org/M", "r1")
    env = _env(hub_cache=tmp_path / "elsewhere", hf_home=tmp_path / "home")
    assert hub_cache_dirs(env)[:2] == [tmp_path / "elsewhere", tmp_path / "home" / "hub"]
    assert resolve_model("Org/M", env) == snap


def test_missing_id_names_id_and_folders(tmp_path):
    env = _env(hub_cache=tmp_path / "a", hf_home=tmp_path / "b")
    with pytest.raises(ConfigError) as e:
        resolve_model("ModelCloud/Not-There", env)
    msg = str(e.value)
    assert "ModelCloud/Not-There" in msg and "HF_HUB_OFFLINE is set" in msg and "hf download" in msg
    assert str(tmp_path / "a" / "models--ModelCloud--Not-There") in msg
    assert str(tmp_path / "b" / "hub" / "models--ModelCloud--Not-There") in msg


def test_snapshot_without_config_is_a_miss(tmp_path):
    cache = tmp_path / "hub"
    (cache / "models--Org--M" / "snapshots" / "r1").mkdir(parents=True)   # interrupted download
    with pytest.raises(ConfigError, match="Org/M"):
        resolve_model("Org/M", _env(hub_cache=cache))


def test_snapshot_missing_a_shard_is_a_miss(tmp_path):
    snap = _snapshot(tmp_path / "hub", "Org/M", "r1")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-1.safetensors"}}')
    with pytest.raises(ConfigError, match="Org/M"):
        resolve_model("Org/M", _env(hub_cache=tmp_path / "hub"))
    (snap / "model-1.safetensors").write_bytes(b"")
    assert resolve_model("Org/M", _env(hub_cache=tmp_path / "hub")) == snap


def test_revision_and_at_syntax(tmp_path):
    cache = tmp_path / "hub"
    old = _snapshot(cache, "Org/M", "a" * 40, mtime=time.time() - 100)
    _snapshot(cache, "Org/M", "b" * 40)
    assert resolve_model("Org/M", _env(hub_cache=cache), revision="a" * 40) == old
    assert resolve_model("Org/M@" + "a" * 40, _env(hub_cache=cache)) == old
    with pytest.raises(ConfigError, match="give one of them"):
        resolve_model("Org/M@v1", _env(hub_cache=cache), revision="v2")
    with pytest.raises(ConfigError, match=r"Org/M@v3.*HF_HUB_OFFLINE"):
        resolve_model("Org/M@v3", _env(hub_cache=cache))


def test_not_a_path_nor_id(tmp_path):
    with pytest.raises(ConfigError, match="neither a local directory nor a hub id"):
        resolve_model("a/b/c", _env(hub_cache=tmp_path))
    with pytest.raises(ConfigError, match="neither a local directory nor a hub id"):
        resolve_model(str(tmp_path / "nope"), _env(hub_cache=tmp_path))


def test_engine_args_resolves_through_the_cache(tmp_path, monkeypatch, tiny_dense_dir):
    """End to end: the fixture model placed in a fake cache resolves by its id via the environment."""
    import shutil

    cache = tmp_path / "hub"
    snap = cache / "models--Org--Tiny" / "snapshots" / "r1"
    shutil.copytree(tiny_dense_dir, snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = EngineArgs(model="Org/Tiny", device="cpu").create_config()
    assert cfg.model.path == snap and cfg.model.model == "Org/Tiny"
    assert cfg.model.served_model_names == ["Org/Tiny"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="Org/Tiny"):
        EngineArgs(model="Org/Tiny", device="cpu").create_config()
