"""Calling an ASGI application in this process, as a server hands it a request: one HTTP
request with its whole body, or a WebSocket's opening, on a given local port of 127.0.0.1 (the
local address and port are how ``llmgw_site.asgi`` tells its listeners apart)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _scope(kind: str, path: str, port: int, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    scope: dict[str, Any] = {"type": kind, "path": path, "headers": headers}
    scope |= {"query_string": b"", "root_path": "", "server": ("127.0.0.1", port)}
    return scope | {"client": ("127.0.0.1", 5), "scheme": "http", "http_version": "1.1"}


async def call_http(
    app: Asgi,
    path: str,
    method: str = "GET",
    key: str | None = None,
    *,
    body: bytes = b"",
    port: int = 80,
) -> tuple[int, bytes]:
    """One request through ``app``: its status and its whole body."""
    headers = [(b"host", b"localhost")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if body:
        headers.append((b"content-type", b"application/json"))
    scope = _scope("http", path, port, headers) | {"method": method}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        # The client stays until its answer is out: a disconnect now would cancel it (Django
        # listens for one while its view runs).
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def call_websocket(app: Asgi, path: str, *, port: int = 80) -> dict[str, Any]:
    """A WebSocket's opening through ``app`` (no token): the first message it sends back."""
    scope = _scope("websocket", path, port, [(b"host", b"localhost")]) | {"subprotocols": []}
    opened = False
    first: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def receive() -> dict[str, Any]:
        nonlocal opened
        if not opened:
            opened = True
            return {"type": "websocket.connect"}
        await first  # then nothing more from the client until the application has answered
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: Any) -> None:
        if not first.done():
            first.set_result(dict(message))

    await app(scope, receive, send)
    assert first.done(), f"the application answered a WebSocket on {path} with nothing"
    return first.result()
