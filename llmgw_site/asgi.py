"""The ASGI application of a web process: HTTP (``/v1``, ``/admin``, ``/healthz``), the agents'
WebSocket streams, and the lifespan messages of servers that send them (uvicorn, granian)."""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from control.routing import websocket_urlpatterns  # noqa: E402
from control.views import health  # noqa: E402
from gateway.edge.asgi import V1App, imported, send_answer  # noqa: E402
from gateway.ledger.usage import recorder  # noqa: E402
from gateway.relay import exchange  # noqa: E402
from gateway.relay.drain import drain  # noqa: E402
from gateway.responses import Response, whole  # noqa: E402
from llmgw_site import listeners  # noqa: E402
from llmgw_site.views import scrape  # noqa: E402
from telemetry import metrics  # noqa: E402

# Where daphne serves (it spools a whole body before the application sees any of it), /v1
# bodies get a guard inside daphne itself; other servers never load Twisted.
if "daphne.server" in sys.modules:
    from gateway.edge.daphne_guard import install_daphne_body_limit

    install_daphne_body_limit()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]

# /v1 goes to an application without Django's middleware (see gateway.edge.asgi); the admin's CSS
# and scripts are served by the web process itself so that the embedded default needs no
# separate web server; agents' streams authenticate their node token on the route itself.
v1 = V1App()
# A stopping process still answers the requests in flight, but tells a balancer to move away.
DRAINING = Response(
    503,
    [(b"content-type", b"application/json"), (b"connection", b"close")],
    b'{"status":"draining"}',
)
NOT_FOUND = Response(404, [(b"content-type", b"application/json")], b'{"error":"not found"}')
site = ASGIStaticFilesHandler(django_asgi)
agent_streams = URLRouter(websocket_urlpatterns)
# The listeners of this process and their roles (set by llmgw_site.webserver); SPLIT is empty
# when one port serves everything, which keeps that path as short as it was.
PORTS = listeners.parse_ports(os.environ.get("LLMGW_LISTENER_PORTS", ""))
SPLIT = frozenset(PORTS.values()) - {"client"}


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    kind = scope["type"]
    if drain.draining and kind == "http":
        send = closing(send)
    if SPLIT:
        await split_application(scope, receive, send)
    elif kind == "http":
        path: str = scope["path"]
        if path.startswith("/v1/") or path == "/v1":
            await v1(scope, receive, send)
        elif path == "/healthz" and drain.draining:
            await send_answer(DRAINING, send)
        else:
            await site_request(scope, receive, send)
    elif kind == "websocket":
        await agent_streams(scope, receive, send)
    elif kind == "lifespan":
        await lifespan(receive, send)
    else:
        raise ValueError(f"no application for ASGI scope type {kind!r}")


async def site_request(scope: Scope, receive: Receive, send: Send) -> None:
    """Django's site: the admin, its dashboard, the account pages; ``/healthz`` without it, as
    balancers call it often and a process that serves only ``/v1`` need never load the site's
    URLconf (the admin, ninja and the rest: most of a second of imports, off the event loop
    when a first admin request does load it)."""
    if scope["type"] == "http" and scope["path"] == "/healthz":
        status, body = await health()
        await send_answer(whole(status, json.dumps(body).encode()), send)
        return
    await imported(settings.ROOT_URLCONF)
    await site(scope, receive, send)


def closing(send: Send) -> Send:
    """While draining, every answer says ``Connection: close``: a kept-alive connection ends
    after it instead of being closed under a client about to reuse it."""

    async def send_closing(message: Mapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_closing


async def split_application(scope: Scope, receive: Receive, send: Send) -> None:
    """Listeners split by role (``llmgw_site.listeners``): each serves only its own part."""
    kind = scope["type"]
    if kind == "lifespan":
        await lifespan(receive, send)
        return
    if kind not in ("http", "websocket"):
        raise ValueError(f"no application for ASGI scope type {kind!r}")
    path: str = scope["path"]
    role = listeners.role_of(PORTS, scope.get("server"))
    answer = listeners.decide(role, SPLIT, kind, path)
    if answer is listeners.Answer.V1:
        await v1(scope, receive, send)
    elif kind == "http" and path == "/healthz" and drain.draining:
        await send_answer(DRAINING, send)
    elif answer is listeners.Answer.SITE:
        await site_request(scope, receive, send)
    elif answer is listeners.Answer.OPEN_METRICS:
        await open_metrics(scope, send)
    elif answer is listeners.Answer.AGENTS:
        await agent_streams(scope, receive, send)
    elif kind == "websocket":
        await send({"type": "websocket.close", "code": 4404})
    else:
        await send_answer(NOT_FOUND, send)


async def open_metrics(scope: Scope, send: Send) -> None:
    """``/metrics`` on the metrics listener: no token, since that listener serves nothing else."""
    if scope["method"] not in ("GET", "HEAD"):
        await send_answer(NOT_FOUND, send)
        return
    accept = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"accept"), "")
    # The fleet's gauges come from the store: off the event loop.
    body, content_type = await sync_to_async(scrape)(accept)
    await send_answer(Response(200, [(b"content-type", content_type.encode())], body), send)


# How long a stopping process waits for background token counts before it closes the journal.
COUNTS_GRACE_S = 10.0


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
            # A stream cut at the grace may still be counting its tokens: its row first.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(COUNTS_GRACE_S):
                    await exchange.counts_settled()
            await sync_to_async(recorder.close)()
            await send({"type": "lifespan.shutdown.complete"})
            return
