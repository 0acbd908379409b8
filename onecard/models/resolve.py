"""Resolve a model argument to a local Hugging Face model directory, without the network.

Contract: ``resolve_model(name, env)`` returns a directory holding config.json. ``name`` is a local path, or a
hub id ``org/name`` looked up in the local HF cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
``~/.cache/huggingface/hub``) as ``models--org--name/snapshots/<rev>/`` (the revision named by
``refs/main`` first, else the newest snapshot). A miss raises ``ConfigError`` naming the id and every folder
searched. onecard never downloads.
"""
from __future__ import annotations

from pathlib import Path

from onecard.config import ConfigError, Env

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


def resolve_model(name: str, env: Env | None = None) -> Path:
    env = env or Env.read()
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ConfigError(f"model directory {local} has no config.json.")
        return local.resolve()
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ConfigError(f"model {name!r} is neither a local directory nor a hub id of the form org/name.")
    searched = []
    for cache in hub_cache_dirs(env):
        repo = cache / ("models--" + name.replace("/", "--"))
        searched.append(str(repo))
        snaps = repo / "snapshots"
        if not snaps.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.exists():
            cand = snaps / ref.read_text().strip()
            if (cand / "config.json").exists():
                return cand
        cands = sorted((p for p in snaps.iterdir() if (p / "config.json").exists()),
                       key=lambda p: p.stat().st_mtime, reverse=True)
        if cands:
            return cands[0]
    raise ConfigError(
        f"model {name!r} was not found locally and onecard does not download. Searched: "
        + ", ".join(searched)
        + ". Download it first (e.g. `huggingface-cli download " + name + "`) or pass a local directory.")
