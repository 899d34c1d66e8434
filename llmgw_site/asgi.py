"""The ASGI application of a web process: HTTP (``/v1``, ``/admin``, ``/healthz``), the agents'
WebSocket streams, and the lifespan messages of servers that send them (uvicorn, granian)."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Django must be set up before anything imports models (Channels routing does).
django_asgi = get_asgi_application()

from asgiref.sync import sync_to_async  # noqa: E402
from channels.routing import URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from control.routing import websocket_urlpatterns  # noqa: E402
from gateway.asgi import V1App  # noqa: E402
from gateway.usage import recorder  # noqa: E402
from llmgw_site import metrics  # noqa: E402

# Where daphne serves (it spools a whole body before the application sees any of it), /v1
# bodies get a guard inside daphne itself; other servers never load Twisted.
if "daphne.server" in sys.modules:
    from gateway.daphne_guard import install_daphne_body_limit

    install_daphne_body_limit()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]

# /v1 goes to an application without Django's middleware (see gateway.asgi); the admin's CSS
# and scripts are served by the web process itself so that the embedded default needs no
# separate web server; agents' streams authenticate their node token on the route itself.
v1 = V1App()
site = ASGIStaticFilesHandler(django_asgi)
agent_streams = URLRouter(websocket_urlpatterns)


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    kind = scope["type"]
    if kind == "http":
        path: str = scope["path"]
        if path.startswith("/v1/") or path == "/v1":
            await v1(scope, receive, send)
        else:
            await site(scope, receive, send)
    elif kind == "websocket":
        await agent_streams(scope, receive, send)
    elif kind == "lifespan":
        await lifespan(receive, send)
    else:
        raise ValueError(f"no application for ASGI scope type {kind!r}")


async def lifespan(receive: Receive, send: Send) -> None:
    """Startup needs nothing (everything starts with the first request). At shutdown, once
    the server has finished the requests in flight, store the usage rows and counters now
    rather than leave them to the interpreter's exit, which a server may skip in its workers."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            metrics.write_tallies()
            await sync_to_async(recorder.close)()
            await send({"type": "lifespan.shutdown.complete"})
            return
