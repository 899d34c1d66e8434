"""The servers' own floor: a raw-ASGI hello world (no upstream), to compare servers alone."""

from __future__ import annotations

from typing import Any

BODY = b'{"hello":"world"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"17")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
