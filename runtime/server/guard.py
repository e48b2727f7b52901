"""The ASGI layer in front of the API: one auth rule, a body limit on the bytes actually
read, and a read timeout — all before any parsing, so a client can neither stall the event
loop with a huge body nor hold a handler with a short one.

- With an API key, every path that does work (`/v1/*`, `/tokenize`, `/detokenize`,
  `/kvdeck/*`, and `/metrics` when asked) needs `Authorization: Bearer KEY`, compared in
  constant time; `/health` stays open. A request without the key is refused before its body
  is read.
- The body is read here, chunked or not, counting bytes: past `max_body_bytes` the answer is
  413 at once; a `Content-Length` over the limit is refused without reading. Reading stops
  after `read_timeout_s` without progress (a `Content-Length` longer than what arrives):
  408. The app then gets the body from memory, and later `receive()` calls reach the client
  (so handlers still see a disconnect).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health",)
log = logging.getLogger("kvdeck.server")


def error_payload(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def send_error(send: Send, status: int, message: str, kind: str,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_payload(status, message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: auth, body limit, read timeout (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 read_timeout_s: float, metrics_need_key: bool = False):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.metrics_need_key = metrics_need_key

    def _needs_key(self, path: str) -> bool:
        if self.key is None or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.metrics_need_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._needs_key(scope["path"]):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                await send_error(send, 401, "Missing or wrong API key; send 'Authorization: "
                                 "Bearer KEY'.", "authentication_error",
                                 [(b"www-authenticate", b"Bearer")])
                return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            if length.isdigit():
                message = (f"The request body is {int(length):,} bytes; the limit is "
                           f"{self.max_body_bytes:,}.")
            else:
                message = f"The Content-Length header {length.decode(errors='replace')!r} " \
                          "is not a number of bytes."
            await send_error(send, 413 if length.isdigit() else 400, message,
                             "invalid_request_error")
            return
        body, problem = await self._read_body(receive)
        if problem is not None:
            await send_error(send, *problem)
            return
        try:
            await self.app(scope, _replay(body, receive), send)
        except asyncio.CancelledError:
            # The server is exiting and cut this connection (a forced shutdown): the request
            # was aborted already; there is nobody left to tell.
            log.debug("%s %s cut by the shutdown", scope.get("method"), scope["path"])

    async def _read_body(self, receive: Receive) -> tuple[bytes, tuple | None]:
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return b"", (408, f"The request body did not arrive within "
                                  f"{self.read_timeout_s:g} s; send the whole body at once.",
                             "invalid_request_error")
            if message["type"] == "http.disconnect":
                return b"", (400, "The client closed the connection before sending the "
                                  "whole body.", "invalid_request_error")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", (413, f"The request body is over the limit of "
                                  f"{self.max_body_bytes:,} bytes.", "invalid_request_error")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then waits on the client (for the
    disconnect a handler may watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
