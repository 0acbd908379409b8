"""The Hugging Face hub, through ``huggingface_hub`` (no hand-written HTTP): cache, download, remote metadata.

Contract:
- ``parse_hub_id(name, revision)`` splits ``org/name[@rev]``; a ``--revision`` that disagrees with ``@rev`` is
  a ``ConfigError``.
- ``cached_snapshot(repo, revision, caches)`` returns a COMPLETE snapshot in one of the cache folders (config.json
  and every safetensors shard the index names present, and huggingface_hub's cached tree listing, when it has
  one, satisfied), else None. No network.
- ``download_snapshot(repo, revision, env, cache_dir)`` downloads what the cache lacks (weights as safetensors,
  configs, tokenizer; other weight formats are skipped, as vLLM does) and returns the snapshot folder. Files
  land as ``blobs/<etag>.incomplete`` first, so a download that is cut and run again resumes with a ranged GET.
  Progress: tqdm's bar on a terminal; otherwise a log line every ``PROGRESS_LOG_EVERY_S`` seconds (bytes, rate,
  ETA). Before any byte moves, the size still to fetch is checked against the free space of ``cache_dir``.
- ``remote_checkpoint_meta(repo, revision, env)`` reads config.json, the quantization config and every shard's
  safetensors header (``HfApi.get_safetensors_metadata``: ranged reads of the shards' first bytes) and returns
  the same ``CheckpointMeta`` a local directory gives; nothing is written to the hub cache.
- Every failure is a ``HubError`` (a ``ConfigError``) naming the repo, the reason (offline, unreachable, 401,
  403 gated, 404, revision, disk full, incomplete cache) and the command that fetches it by hand (``hf download``).
The endpoint, token and offline switch come from ``Env`` (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE) and are passed
to huggingface_hub explicitly.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from onecard.checkpoint_meta import (
    DTYPE_BYTES,
    CheckpointMeta,
    TensorMeta,
    read_checkpoint_meta,
    read_json,
    shard_names,
)
from onecard.env import ConfigError, Env

logger = logging.getLogger(__name__)

PROGRESS_LOG_EVERY_S = 10.0
# Weights in formats onecard does not load are not downloaded (vLLM skips them the same way).
IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.tflite",
                   "original/*", "onnx/*"]


class HubError(ConfigError):
    """A hub id that cannot be resolved: the message names the repo, the reason and `hf download`."""


def parse_hub_id(name: str, revision: str | None = None) -> tuple[str, str | None]:
    repo, sep, rev = name.partition("@")
    if sep and not rev:
        raise ConfigError(f"model {name!r}: an empty revision after '@'; use ORG/NAME@REVISION.")
    if sep and revision and revision != rev:
        raise ConfigError(f"model {name!r} names revision {rev!r} but --revision={revision}; give one of them.")
    if repo.count("/") != 1 or repo.startswith((".", "/", "~")) or not all(repo.split("/")):
        raise ConfigError(f"model {name!r} is neither a local directory nor a hub id of the form org/name.")
    return repo, (rev or revision or None)


def hf_download_command(repo: str, revision: str | None, cache_dir: Path | None = None) -> str:
    cmd = f"hf download {repo}"
    if revision:
        cmd += f" --revision {revision}"
    if cache_dir is not None:
        cmd += f" --cache-dir {cache_dir}"
    return f"`{cmd}`"


# ---------------------------------------------------------------- the cache
def _snapshot_is_complete(folder: Path) -> bool:
    if not (folder / "config.json").exists():
        return False
    try:
        shards = shard_names(folder)
    except ConfigError:
        return False
    return all((folder / s).exists() for s in shards)


def cached_snapshot(repo: str, revision: str | None, caches: list[Path]) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    for cache in caches:
        if not (cache / ("models--" + repo.replace("/", "--"))).is_dir():
            continue
        try:
            folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True,
                                            ignore_patterns=IGNORE_PATTERNS))
        except IncompleteSnapshotError:
            continue
        except LocalEntryNotFoundError:
            folder = _fallback_snapshot(cache, repo, revision)
            if folder is None:
                continue
        if _snapshot_is_complete(folder):
            return folder
    return None


def _fallback_snapshot(cache: Path, repo: str, revision: str | None) -> Path | None:
    """A cache written by hand or an older tool: refs/<rev> (whitespace tolerated), a snapshot named <rev>,
    else (no revision asked for) the newest complete snapshot."""
    root = cache / ("models--" + repo.replace("/", "--"))
    ref = root / "refs" / (revision or "main")
    if ref.is_file():
        cand = root / "snapshots" / ref.read_text().strip()
        return cand if _snapshot_is_complete(cand) else None
    if revision is not None:
        cand = root / "snapshots" / revision
        return cand if _snapshot_is_complete(cand) else None
    snaps = root / "snapshots"
    if not snaps.is_dir():
        return None
    cands = sorted((p for p in snaps.iterdir() if _snapshot_is_complete(p)), key=lambda p: p.stat().st_mtime,
                   reverse=True)
    return cands[0] if cands else None


# ---------------------------------------------------------------- progress
def _progress_class() -> type:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class LogProgress(hf_tqdm):
        """tqdm's bar on a terminal; in a log (a pod), a line every PROGRESS_LOG_EVERY_S s per byte counter."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._as_log = not sys.stderr.isatty()
            self._last_log = 0.0
            if self._as_log:
                kwargs["disable"] = False          # tqdm would switch itself off without a terminal
                kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed with the bar
            super().__init__(*args, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if not self._as_log:
                return super().display(msg, pos)
            if self.unit != "B" or not self.total or not str(self.desc).startswith("Downloading"):
                return True
            now = time.monotonic()
            if now - self._last_log < PROGRESS_LOG_EVERY_S:
                return True
            self._last_log = now
            d = self.format_dict
            rate = d.get("rate") or (self.n / d["elapsed"] if d.get("elapsed") else 0.0)
            eta = (self.total - self.n) / rate if rate else float("inf")
            logger.info("download: %s of %s (%.0f%%), %s/s, ETA %s", self.format_sizeof(self.n, "B", 1024),
                        self.format_sizeof(self.total, "B", 1024), 100.0 * self.n / self.total,
                        self.format_sizeof(rate, "B", 1024), "?" if eta == float("inf") else
                        self.format_interval(eta))
            return True

        def close(self) -> None:
            fp = getattr(self, "fp", None)
            super().close()
            if self._as_log and fp is not None and not fp.closed:
                fp.close()

    return LogProgress


# ---------------------------------------------------------------- errors
def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _status(e: BaseException) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)


def hub_error(exc: BaseException, repo: str, revision: str | None, env: Env, cache_dir: Path | None,
              searched: list[Path] | None = None) -> HubError:
    """The exception huggingface_hub raised, as one sentence an operator can act on."""
    from huggingface_hub import errors as hf

    at = f"{env.hf_endpoint}/{repo}"
    reason = None
    for e in _chain(exc):
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, hf.GatedRepoError):
            reason = (f"it is a gated repo (403): accept its conditions at {at} with your account and set "
                      "HF_TOKEN to a token of that account" + (" (the HF_TOKEN given has no access)"
                                                                if env.hf_token else ""))
        elif isinstance(e, hf.RevisionNotFoundError):
            reason = f"revision {revision or 'main'!r} does not exist in it (404)"
        elif isinstance(e, hf.RepositoryNotFoundError):
            if _status(e) == 401:
                reason = ("it does not exist or is private (401): check the id; for a private repo set HF_TOKEN"
                          + (" (the HF_TOKEN given was not accepted)" if env.hf_token else ""))
            else:
                reason = f"it does not exist on {env.hf_endpoint} ({_status(e) or 404})"
        elif isinstance(e, hf.RemoteEntryNotFoundError):
            reason = f"a file is missing on the hub (404: {e})"
        elif isinstance(e, hf.HfHubHTTPError) and _status(e) in (401, 403):
            reason = f"the hub refused access ({_status(e)}): set HF_TOKEN to a token with access to it"
        elif isinstance(e, hf.OfflineModeIsEnabled) or (isinstance(e, hf.LocalEntryNotFoundError)
                                                        and env.hf_hub_offline):
            reason = "HF_HUB_OFFLINE is set and it is not (completely) in the local cache"
        elif isinstance(e, hf.IncompleteSnapshotError):
            reason = f"the cached snapshot is incomplete and the hub cannot be reached ({e})"
        elif names & {"ConnectError", "ConnectTimeout", "TimeoutException", "ReadTimeout", "ConnectionError",
                      "RemoteProtocolError", "ReadError"}:
            reason = f"the hub at {env.hf_endpoint} cannot be reached ({type(e).__name__}: {e})"
        elif isinstance(e, OSError) and e.errno == errno.ENOSPC:
            reason = f"the disk holding {cache_dir} is full (ENOSPC)"
        if reason:
            break
    if reason is None:
        reason = f"{type(exc).__name__}: {exc}"
    where = ""
    if searched:
        where = " Searched the cache in: " + ", ".join(str(p) for p in searched) + "."
    rev = f"@{revision}" if revision else ""
    return HubError(f"cannot get model {repo}{rev} from the hub: {reason}.{where} To fetch it by hand: "
                    f"{hf_download_command(repo, revision, cache_dir)}, or pass a local directory.")


# ---------------------------------------------------------------- download
def _check_disk_space(repo: str, revision: str | None, env: Env, cache_dir: Path) -> None:
    from huggingface_hub import snapshot_download

    plan = snapshot_download(repo, revision=revision, cache_dir=cache_dir, token=env.hf_token or None,
                             endpoint=env.hf_endpoint, ignore_patterns=IGNORE_PATTERNS, dry_run=True,
                             tqdm_class=_progress_class())
    need = sum(int(f.file_size or 0) for f in plan if f.will_download)  # type: ignore[union-attr]
    check_free_space(repo, revision, need, cache_dir)


def check_free_space(repo: str, revision: str | None, need: int, cache_dir: Path,
                     free: int | None = None) -> None:
    """HubError when ``need`` bytes do not fit the free space of the disk under ``cache_dir``."""
    if free is None:
        probe = cache_dir
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
    if need > free:
        raise HubError(
            f"cannot get model {repo} from the hub: the disk holding {cache_dir} is too full: the download needs "
            f"{need / 1e9:.2f} GB and {free / 1e9:.2f} GB is free. Free space, or pass --download-dir on a larger "
            f"volume. To fetch it by hand: {hf_download_command(repo, revision, cache_dir)}.")


def download_snapshot(repo: str, revision: str | None, env: Env, cache_dir: Path,
                      searched: list[Path] | None = None) -> Path:
    from huggingface_hub import snapshot_download

    if env.hf_hub_offline:
        folders = ", ".join(str(c / ("models--" + repo.replace("/", "--"))) for c in (searched or [cache_dir]))
        rev = f"@{revision}" if revision else ""
        raise HubError(f"cannot get model {repo}{rev}: HF_HUB_OFFLINE is set and no complete snapshot is in the "
                       f"local cache (searched {folders}). Unset HF_HUB_OFFLINE to download it, or fetch it "
                       f"first: {hf_download_command(repo, revision, cache_dir)}.")
    for noisy in ("httpx", "httpx2"):          # one line per HEAD/GET would drown the progress lines
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger(noisy).level))
    t0 = time.monotonic()
    logger.info("downloading %s%s from %s into %s", repo, f"@{revision}" if revision else "", env.hf_endpoint,
                cache_dir)
    try:
        _check_disk_space(repo, revision, env, cache_dir)
        folder = snapshot_download(repo, revision=revision, cache_dir=cache_dir, token=env.hf_token or None,
                                   endpoint=env.hf_endpoint, ignore_patterns=IGNORE_PATTERNS,
                                   tqdm_class=_progress_class())
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one message that names the repo
        raise hub_error(e, repo, revision, env, cache_dir) from None
    folder = Path(folder)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    logger.info("downloaded %s: %.2f GB in %.1f s -> %s", repo, size / 1e9, time.monotonic() - t0, folder)
    if not _snapshot_is_complete(folder):
        raise HubError(f"model {repo} was downloaded to {folder} but has no config.json or safetensors weights; "
                       "onecard loads safetensors checkpoints only.")
    return folder


# ---------------------------------------------------------------- remote metadata
def remote_checkpoint_meta(repo: str, revision: str | None, env: Env) -> CheckpointMeta:
    """config.json + quantization config + safetensors headers over HTTP; tensor data is never fetched."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    if env.hf_hub_offline:
        raise HubError(f"cannot plan model {repo}: HF_HUB_OFFLINE is set and it is not in the local cache. "
                       f"Unset HF_HUB_OFFLINE, or fetch it first: {hf_download_command(repo, revision)}.")
    api = HfApi(endpoint=env.hf_endpoint, token=env.hf_token or None)
    common = dict(revision=revision, endpoint=env.hf_endpoint, token=env.hf_token or None)
    with tempfile.TemporaryDirectory(prefix="onecard-meta-") as tmp:
        try:
            cfg_file = Path(hf_hub_download(repo, "config.json", local_dir=tmp, **common))
            cfg = read_json(cfg_file)
            if "quantization_config" not in cfg:
                try:
                    hf_hub_download(repo, "quantize_config.json", local_dir=tmp, **common)
                except RemoteEntryNotFoundError:
                    pass                                   # a float checkpoint
            st = api.get_safetensors_metadata(repo, revision=revision)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - one message that names the repo and the reason
            raise hub_error(e, repo, revision, env, None) from None
        meta = read_checkpoint_meta(cfg_file.parent, cfg, with_tensors=False)
    meta.path = Path(f"{env.hf_endpoint}/{repo}" + (f"@{revision}" if revision else ""))
    meta.files = sorted(st.files_metadata)
    for fname, fmeta in st.files_metadata.items():
        for name, info in fmeta.tensors.items():
            dtype = str(info.dtype)
            if dtype not in DTYPE_BYTES:
                raise ConfigError(f"{repo}/{fname}: tensor {name!r} has unknown dtype {dtype!r}.")
            t = TensorMeta(name=name, dtype=dtype, shape=tuple(int(s) for s in info.shape), file=fname)
            begin, end = info.data_offsets
            if int(end) - int(begin) != t.nbytes:
                raise ConfigError(f"{repo}/{fname}: tensor {name!r} {dtype}{list(t.shape)} spans "
                                  f"{int(end) - int(begin)} B, expected {t.nbytes} B.")
            meta.tensors[name] = t
    return meta
