"""L1 of the benchmark: the Python floor. A raw-ASGI relay (no Django, no auth, no accounting)
with the same upstream client as llmgw (``gateway.relay.upstream_client``, which imports nothing of
Django's), served by the same server as llmgw. Whatever llmgw costs above this is its own.

    BENCH_UPSTREAM=http://127.0.0.1:PORT python -m llmgw_site.webserver --app bench.relay:app ...
"""

from __future__ import annotations

import os
from typing import Any

from gateway.relay.upstream_client import Pool
from gateway.routing.table import Upstream

# The operator's own upstream: any address (the policy "any"), no engine key.
UPSTREAM = Upstream("bench", os.environ.get("BENCH_UPSTREAM", "http://127.0.0.1:8000"))
HEADERS = b"Content-Type: application/json\r\n"
_pool: Pool | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _pool
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if _pool is None:
        _pool = Pool(keepalive_s=4.0)
    upstream = await _pool.post(UPSTREAM, scope["path"], body, HEADERS, connect_timeout=5.0)
    content_type = upstream.headers.get(b"content-type", b"application/json")
    await send(
        {
            "type": "http.response.start",
            "status": upstream.status,
            "headers": [(b"content-type", content_type)],
        }
    )
    while piece := await upstream.read_piece():
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    upstream.release()
    await send({"type": "http.response.body", "body": b""})
