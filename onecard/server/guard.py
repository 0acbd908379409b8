"""The request guard: one plain-ASGI middleware in front of every route (present and future).

Contract: ``RequestGuard(app, options=ServerConfig)`` (the server's options: ``--api-key``,
``--max-request-body-bytes``, ``--disable-log-requests``) for each HTTP request, in order:
- API key (when set): paths under ``/v1`` need ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
  (Anthropic's clients; errors under /v1/messages come in Anthropic's shape) (vLLM's current rule, its
  ``AuthenticationMiddleware``: ``/tokenize``, ``/detokenize``, ``/health``, ``/metrics`` stay open; the body
  limit and the off-loop tokenizer keep ``/tokenize`` from hurting other traffic). The *first* Authorization header counts (as Starlette's ``Headers.get``,
  which vLLM reads); the key is compared in constant time (SHA-256 digests, ``hmac.compare_digest``). 401
  otherwise.
- Body size: a body over ``max_request_body_bytes`` is answered 413 without reading past the limit (a declared
  ``Content-Length`` is refused before any byte is read). The body is read here, once, and replayed to the
  app, so JSON parsing never waits on a slow client inside a route.
- Disconnect: after the body, this middleware owns ``receive``; when the client goes away before the response
  has started (a non-streaming request still generating), the route is cancelled, which aborts its engine
  requests and frees their KV blocks. A started (streaming) response sees the disconnect through ``receive``
  as Starlette expects.
- Access log: one line per request on the ``onecard.access`` logger (client, method, path, status, bytes,
  seconds; 499 when the client left first), unless ``--disable-log-requests``.
Plain ASGI (not BaseHTTPMiddleware) so streaming and cancellation pass through untouched.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time

from onecard.config import ServerConfig
from onecard.server.errors import error_response_for

access_logger = logging.getLogger("onecard.access")

CLIENT_CLOSED_REQUEST = 499      # nginx's status for "the client left before the response": access log only


def _first_header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value
    return None


class RequestGuard:
    def __init__(self, app, options: ServerConfig):
        self.app = app
        self.options = options
        key = options.api_key
        self._key_digest = hashlib.sha256(key.encode()).digest() if key else None

    # ------------------------------------------------------------------ checks
    def _authorized(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self._key_digest is None or scope["method"] == "OPTIONS" or not path.startswith("/v1"):
            return True
        raw = _first_header(scope, b"authorization")
        if raw is not None:
            scheme, _, token = raw.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode("latin-1")).digest(), self._key_digest):
                return True
        x_key = _first_header(scope, b"x-api-key")        # Anthropic's clients send the key here
        return x_key is not None and hmac.compare_digest(hashlib.sha256(x_key).digest(), self._key_digest)

    def _too_large(self, path: str, size: int | str) -> object:
        limit = self.options.max_request_body_bytes
        return error_response_for(path, f"The request body ({size} bytes) is larger than this server accepts "
                                  f"({limit} bytes, --max-request-body-bytes).", 413)

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.monotonic()
        sent = {"status": None, "bytes": 0}

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body":
                sent["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self._handle(scope, receive, send_counted)
        finally:
            if not self.options.disable_log_requests:
                client = scope.get("client") or ("-", 0)
                status = sent["status"] if sent["status"] is not None else CLIENT_CLOSED_REQUEST
                access_logger.info('%s:%s - "%s %s HTTP/%s" %d %dB %.3fs', client[0], client[1], scope["method"],
                                   scope["path"], scope.get("http_version", "1.1"), status, sent["bytes"],
                                   time.monotonic() - started_at)

    async def _handle(self, scope, receive, send) -> None:
        if not self._authorized(scope):
            await error_response_for(scope["path"], "Unauthorized: a valid API key is required.", 401)(
                scope, receive, send)
            return
        limit = self.options.max_request_body_bytes
        declared = _first_header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope["path"], int(declared))(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                          # gone before the body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope["path"], f"more than {limit}")(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self._run(scope, b"".join(chunks), receive, send)

    async def _run(self, scope, body: bytes, receive, send) -> None:
        disconnected = asyncio.Event()
        response_started = False
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send_tracked(message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch(), name="onecard-disconnect-watch")
        app_task = asyncio.create_task(self.app(scope, replay, send_tracked), name="onecard-route")
        gone = asyncio.create_task(disconnected.wait())
        try:
            while not app_task.done():
                await asyncio.wait({app_task, gone}, return_when=asyncio.FIRST_COMPLETED)
                if disconnected.is_set() and not response_started and not app_task.done():
                    app_task.cancel()          # the client left a non-streaming request: stop its work
                    with contextlib.suppress(asyncio.CancelledError):
                        await app_task
                    return
                if gone.done():
                    # Started (streaming) response: Starlette sees the disconnect via replay(); wait for it.
                    await asyncio.wait({app_task})
            app_task.result()                  # re-raise what the app raised (uvicorn logs it)
        finally:
            for task in (watcher, gone, app_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(watcher, gone, app_task, return_exceptions=True)
