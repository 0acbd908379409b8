"""A local Hugging Face hub: a real HTTP server on 127.0.0.1 that ``HF_ENDPOINT`` points huggingface_hub at.

It serves the endpoints ``snapshot_download``, ``hf_hub_download`` and ``get_safetensors_metadata`` use —
``/api/models/ORG/NAME[/revision/REV]`` (repo info), ``/api/models/ORG/NAME/tree/REV`` (file listing with LFS
sizes) and ``HEAD|GET /ORG/NAME/resolve/REV/FILE`` (ETag, X-Repo-Commit, ranged GETs answered 206) — from
folders on disk, and counts every body byte it sends per file. Errors carry the hub's ``X-Error-Code`` header
(RepoNotFound 404, 401 for a private repo without its token, GatedRepo 403, EntryNotFound, RevisionNotFound).
Fault injection: ``cut_after[file] = N`` drops the connection after N body bytes of the next GET of ``file``
(then sets ``down`` when ``down_after_cut``); ``down = True`` drops every connection without an answer (an
outage) until cleared.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 16
LFS_MIN = 10 << 20            # files from this size on are "LFS" (sha256 ETag, X-Linked-Size), as on the hub


@dataclass
class Repo:
    repo_id: str
    folder: Path
    sha: str = ""
    token: str | None = None          # private: needs `Authorization: Bearer <token>`
    gated: bool = False               # 403 GatedRepo unless the token is given
    hash_files: bool = True           # False: a cheap stand-in ETag (sparse multi-GB files never downloaded)
    etags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sha = self.sha or hashlib.sha1(self.repo_id.encode()).hexdigest()
        for f in self.files():
            p = self.folder / f
            if self.hash_files:
                h = hashlib.sha256()
                with p.open("rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
                self.etags[f] = h.hexdigest()
            else:
                self.etags[f] = hashlib.sha256(f"{f}:{p.stat().st_size}".encode()).hexdigest()

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())


class LocalHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.bytes_sent: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, str | None]] = []      # (method, path, Range header)
        self.cut_after: dict[str, int] = {}
        self.down_after_cut = False
        self.down = False
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo

    def served(self, repo_id: str | None = None) -> int:
        with self.lock:
            return sum(n for (r, _), n in self.bytes_sent.items() if repo_id is None or r == repo_id)

    # ------------------------------------------------------------ request handling
    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self.lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        if self.down:
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            return self._api(h, m.group(1), m.group(2) or "main", "info")
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path):
            return self._api(h, m.group(1), m.group(2), "tree")
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._file(h, m.group(1), m.group(2), m.group(3), head)
        self._error(h, 404, None, "no such endpoint")

    def _error(self, h, status: int, code: str | None, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _check(self, h, repo_id: str, revision: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        auth = h.headers.get("Authorization")
        if repo is None:
            self._error(h, 401 if auth is None else 404, "RepoNotFound", "Repository not found")
            return None
        authorized = repo.token is not None and auth == f"Bearer {repo.token}"
        if repo.token is not None and not repo.gated and not authorized:
            self._error(h, 401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and not authorized:
            self._error(h, 403, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                             "to it and be authenticated to access it. Please log in.")
            return None
        if revision not in ("main", repo.sha):
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _json(self, h, obj) -> None:
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _api(self, h, repo_id: str, revision: str, what: str) -> None:
        repo = self._check(h, repo_id, revision)
        if repo is None:
            return
        files = repo.files()
        if what == "info":
            return self._json(h, {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": repo.token
                                  is not None, "gated": repo.gated, "siblings": [{"rfilename": f} for f in files]})
        entries = []
        for f in files:
            size = (repo.folder / f).stat().st_size
            e = {"type": "file", "oid": hashlib.sha1(repo.etags[f].encode()).hexdigest(), "size": size, "path": f}
            if size >= LFS_MIN:
                e["lfs"] = {"oid": repo.etags[f], "size": size, "pointerSize": 134}
            entries.append(e)
        self._json(h, entries)

    def _file(self, h, repo_id: str, revision: str, name: str, head: bool) -> None:
        repo = self._check(h, repo_id, revision)
        if repo is None:
            return
        file = repo.folder / name
        if name not in repo.etags or not file.is_file():
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist on {revision}")
        size = file.stat().st_size
        start, end = 0, size - 1
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())):
            start = int(m.group(1) or 0)
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        partial = rng is not None
        h.send_response(206 if partial else 200)
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{repo.etags[name]}"')
        h.send_header("Accept-Ranges", "bytes")
        if size >= LFS_MIN:
            h.send_header("X-Linked-Etag", f'"{repo.etags[name]}"')
            h.send_header("X-Linked-Size", str(size))
        if partial:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.send_header("Content-Length", str(end - start + 1))
        h.end_headers()
        if head:
            return
        cut = self.cut_after.pop(name, None)
        sent = 0
        with file.open("rb") as fh:
            fh.seek(start)
            left = end - start + 1
            while left > 0:
                n = min(CHUNK, left) if cut is None else min(CHUNK, left, cut - sent)
                block = fh.read(n)
                try:
                    h.wfile.write(block)
                except OSError:
                    break
                sent += len(block)
                left -= len(block)
                if cut is not None and sent >= cut:        # the connection drops mid-body
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(socket.SHUT_RDWR)
                    self.down = self.down_after_cut
                    break
        with self.lock:
            key = (repo_id, name)
            self.bytes_sent[key] = self.bytes_sent.get(key, 0) + sent
