"""L1 of the benchmark: the Python floor. A raw-ASGI relay (no Django, no auth, no accounting)
using the same upstream client as llmgw (one aiohttp session), served by the same server
(daphne). Whatever llmgw costs above this is llmgw's own.

    BENCH_UPSTREAM=http://127.0.0.1:PORT daphne bench.relay:app
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

UPSTREAM = os.environ.get("BENCH_UPSTREAM", "http://127.0.0.1:8000")
_session: aiohttp.ClientSession | None = None


def session() -> aiohttp.ClientSession:
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
    return _session


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    async with session().request(
        scope["method"],
        UPSTREAM + scope["path"],
        data=body,
        headers={"Content-Type": "application/json"},
    ) as upstream:
        headers = [(b"content-type", upstream.headers.get("Content-Type", "").encode())]
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        async for chunk in upstream.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
