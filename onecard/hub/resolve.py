"""Resolve a model argument to a local Hugging Face model directory, as `vllm serve` does.

Contract: ``resolve_model(name, env, revision=None, download_dir=None)`` returns a directory holding
config.json and its safetensors shards. ``name`` is a local path, or a hub id ``org/name[@revision]``: the cache
first (``--download-dir`` when given, else ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``;
a complete snapshot of the revision, ``refs/<revision>`` naming it, else the newest complete one), then a
download from the hub into ``download_cache_dir`` unless ``HF_HUB_OFFLINE`` is set (``onecard.hub.download``:
progress, resume, errors that name the repo, the reason and ``hf download``). ``cached_model`` is the first
half only (the planner reads remote metadata instead of downloading).
"""
from __future__ import annotations

from pathlib import Path

from onecard.env import ConfigError, Env
from onecard.hub.download import cached_snapshot, download_snapshot, parse_hub_id

DEFAULT_MODEL_NAME = "onecard-tiny-coder"


def default_model_path() -> Path:
    """The bundled tiny 4-bit Qwen3-MoE coder (package data)."""
    path = Path(__file__).resolve().parent.parent / "data" / DEFAULT_MODEL_NAME
    if not (path / "config.json").exists():
        raise ConfigError(f"the bundled default model is missing at {path}; pass a MODEL argument.")
    return path


def hub_cache_dirs(env: Env) -> list[Path]:
    dirs: list[Path] = []
    if env.hf_hub_cache:
        dirs.append(Path(env.hf_hub_cache))
    if env.hf_home:
        dirs.append(Path(env.hf_home) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def download_cache_dir(env: Env, download_dir: str | None = None) -> Path:
    """Where a download goes: --download-dir, else huggingface_hub's default cache (HF_HUB_CACHE, HF_HOME/hub)."""
    return Path(download_dir).expanduser() if download_dir else hub_cache_dirs(env)[0]


def resolve_model(name: str, env: Env | None = None, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    env = env or Env.read()
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ConfigError(f"model directory {local} has no config.json.")
        return local.resolve()
    repo, rev = parse_hub_id(name, revision)
    caches = [Path(download_dir).expanduser()] if download_dir else hub_cache_dirs(env)
    found = cached_snapshot(repo, rev, caches)
    if found is not None:
        return found
    return download_snapshot(repo, rev, env, download_cache_dir(env, download_dir), searched=caches)


def cached_model(name: str, env: Env | None = None, revision: str | None = None,
                 download_dir: str | None = None) -> Path | None:
    """A local directory, or a complete cached snapshot of a hub id; None when only the hub has it."""
    env = env or Env.read()
    local = Path(name).expanduser()
    if local.is_dir():
        return resolve_model(name, env)
    repo, rev = parse_hub_id(name, revision)
    return cached_snapshot(repo, rev, [Path(download_dir).expanduser()] if download_dir else hub_cache_dirs(env))
