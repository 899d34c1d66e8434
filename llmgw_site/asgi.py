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
from gateway.edge.asgi import V1App, imported, prepare, send_answer  # noqa: E402
from gateway.ledger.recorder import recorder  # noqa: E402
from gateway.relay import exchange  # noqa: E402
from gateway.relay.drain import drain  # noqa: E402
from gateway.responses import Response, whole  # noqa: E402
from llmgw_site import listeners  # noqa: E402
from llmgw_site.views import scrape  # noqa: E402
from telemetry import metrics, tracing  # noqa: E402

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
# The listeners of this process, by local address and port, and their roles (published by
# llmgw_site.webserver), and what each answers (llmgw_site.listeners); with one listener,
# everything is the client's.
LISTENERS = listeners.parse_listeners(os.environ.get("LLMGW_LISTENERS", ""))
ROUTERS = listeners.routers(frozenset(LISTENERS.values()))


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    kind = scope["type"]
    if kind == "http":
        if drain.draining:
            send = closing(send)
    elif kind == "lifespan":
        await lifespan(receive, send)
        return
    elif kind != "websocket":
        raise ValueError(f"no application for ASGI scope type {kind!r}")
    router = ROUTERS[listeners.role_of(LISTENERS, scope.get("server"))]
    await ANSWERS[router.answer(kind, scope["path"])](scope, receive, send)


async def healthz(scope: Scope, receive: Receive, send: Send) -> None:
    """``/healthz``, answered here only: 503 ``draining`` once this process's stop began, else
    the store's answer. Without Django, as balancers call it often and a process that serves
    only ``/v1`` need never load the site's URLconf."""
    if drain.draining:
        await send_answer(DRAINING, send)
        return
    status, body = await health()
    await send_answer(whole(status, json.dumps(body).encode()), send)


async def site_request(scope: Scope, receive: Receive, send: Send) -> None:
    """Django's site: the admin, its dashboard, the account pages. Its URLconf (the admin, ninja
    and the rest: most of a second of imports) is loaded off the event loop by the first
    request that needs it."""
    await imported(settings.ROOT_URLCONF)
    await site(scope, receive, send)


async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """What a listener does not serve."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 4404})
    else:
        await send_answer(NOT_FOUND, send)


def closing(send: Send) -> Send:
    """While draining, every answer says ``Connection: close``: a kept-alive connection ends
    after it instead of being closed under a client about to reuse it."""

    async def send_closing(message: Mapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_closing


async def open_metrics(scope: Scope, receive: Receive, send: Send) -> None:
    """``/metrics`` on the metrics listener: no token, since that listener serves nothing else."""
    if scope["method"] not in ("GET", "HEAD"):
        await send_answer(NOT_FOUND, send)
        return
    accept = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"accept"), "")
    # The fleet's gauges come from the store: off the event loop.
    body, content_type = await sync_to_async(scrape)(accept)
    await send_answer(Response(200, [(b"content-type", content_type.encode())], body), send)


App = Callable[[Scope, Receive, Send], Awaitable[None]]
# The application behind each of the table's answers.
ANSWERS: dict[listeners.Answer, App] = {
    listeners.Answer.V1: v1,
    listeners.Answer.HEALTH: healthz,
    listeners.Answer.SITE: site_request,
    listeners.Answer.OPEN_METRICS: open_metrics,
    listeners.Answer.AGENTS: agent_streams,
    listeners.Answer.NOT_FOUND: not_found,
}

# How long a stopping process waits for background token counts before it closes the journal.
COUNTS_GRACE_S = 10.0


# What startup began for /v1 (held here: the loop keeps only a weak reference to a task).
_preparing: set[asyncio.Task[None]] = set()


async def lifespan(receive: Receive, send: Send) -> None:
    """Startup starts this process's tracing, if the environment asks for it (here, in the
    process that serves: a server may fork its workers after loading the application), and
    begins what the first ``/v1`` request would otherwise begin and wait for
    (``gateway.edge.asgi.prepare``), without waiting for it: the process serves at once, and a
    request that comes meanwhile waits for the same work, not for a second copy. At shutdown,
    once the server has finished the requests in flight, store the usage rows and counters and
    export the queued spans now rather than leave them to the interpreter's exit, which a
    server may skip in its workers."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            tracing.start("web")
            task = asyncio.get_running_loop().create_task(prepare(), name="llmgw-prepare-v1")
            _preparing.add(task)
            task.add_done_callback(_preparing.discard)
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            metrics.write_tallies()
            # A stream cut at the grace may still be counting its tokens: its row first.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(COUNTS_GRACE_S):
                    await exchange.counts_settled()
            await sync_to_async(recorder.close)()
            await asyncio.to_thread(tracing.shutdown)  # the last batch's export may take a while
            await send({"type": "lifespan.shutdown.complete"})
            return
