"""The ASGI application that serves ``/v1``: raw ASGI for the relay routes and the model list,
ninja for the rest.

The routes that go to an engine (``gateway.relay.routes``) are answered here, and only here
(``gateway.edge.api`` documents them), without Django: no request object, no URL resolver, no
middleware, no ``HttpResponse``. This application reads
the body (refusing one over ``LLMGW_MAX_BODY_BYTES`` with 413 as soon as its declared length,
or for a chunked upload the bytes received so far, passes the limit), authenticates the key,
calls ``gateway.relay.entry.relay`` and writes its ``Response``, a stream chunk by chunk as each
arrives; ``GET /v1/models`` too (clients list models often, some as a health check). Every
other ``/v1`` path (key usage, the OpenAPI document) goes through django-ninja, on Django's
handler without middleware and request signals: ``/v1`` authenticates bearer keys itself and
touches the database only off the request path, in its own thread (see ``gateway.dbthread``),
so the stock middleware's thread hops buy nothing.

Nothing here depends on one ASGI server: uvicorn, granian and daphne all hand the body over
as it arrives, so the limit holds on each (daphne also gets a guard of its own, because it
spools the whole body before it calls the application: ``gateway.edge.daphne_guard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler, ASGIRequest
from django.core.handlers.exception import convert_exception_to_response
from django.db import DatabaseError
from django.urls import set_script_prefix

from gateway.errors import ApiError, error_response, invalid_key, openai_shaped, too_large
from gateway.identity import keys
from gateway.identity.keys import KeyInfo
from gateway.relay import entry
from gateway.relay.drain import drain
from gateway.relay.routes import BY_PATH, RelayRoute
from gateway.responses import Response
from gateway.routing.upstreams import upstreams

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
# A request's traceparent and tracestate headers, as they came (None: not sent).
TraceHeaders = tuple[bytes | None, bytes | None]
NO_TRACE: TraceHeaders = (None, None)


class BodyTooLarge(Exception):
    pass


class RequestGone(Exception):
    pass


def _refused_body() -> Response:
    # The rest of the body is never read, so the connection cannot carry another request.
    refusal = error_response(too_large())
    refusal.headers.append((b"connection", b"close"))
    return refusal


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` once more than ``limit`` bytes have come."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise RequestGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_answer(response: Response, send: Send) -> None:
    """Write a relay answer; a stream's chunks go out as they come, never collected. What
    follows the answer (``Response.after``) runs once it is written, or once writing failed
    (the client gone, this process's stop cutting it): not before, so the client does not
    wait for it."""
    start = {"type": "http.response.start", "status": response.status, "headers": response.headers}
    if response.stream is None:
        try:
            await send(start)
            await send({"type": "http.response.body", "body": response.body})
        finally:
            response.settled()
        return
    await send(start)
    async with contextlib.aclosing(response.stream) as parts:
        async for part in parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _answer(
    route: RelayRoute,
    authorization: bytes | None,
    body: bytes,
    clock_start: float,
    session: bytes | None,
    *,
    trace: TraceHeaders = NO_TRACE,
) -> Response:
    key = await _key_or_refusal(authorization)
    if isinstance(key, Response):
        return key
    named = session.decode("latin-1") if session else None
    traceparent, tracestate = (value.decode("latin-1") if value else "" for value in trace)
    return await entry.relay(
        body, key, route, clock_start, session=named, traceparent=traceparent, tracestate=tracestate
    )


async def _key_or_refusal(authorization: bytes | None) -> KeyInfo | Response:
    try:
        key = await keys.authenticate(authorization.decode("latin-1") if authorization else None)
    except ApiError as error:
        return error_response(error)
    return error_response(invalid_key()) if key is None else key


async def _models(authorization: bytes | None) -> Response:
    key = await _key_or_refusal(authorization)
    return key if isinstance(key, Response) else await entry.model_list(key)


async def _relay(
    route: RelayRoute,
    authorization: bytes | None,
    body: bytes,
    clock_start: float,
    *,
    session: bytes | None,
    trace: TraceHeaders = NO_TRACE,
    receive: Receive,
    send: Send,
) -> None:
    """Answer one relay request, and stop it the moment its client hangs up.

    No server cancels an application when its client goes away; it only says so through
    ``receive``. A second task listens there and cancels this one, which closes the upstream
    connection (so the engine stops generating) and records the request as disconnected.
    A stop whose grace is over cancels it too (``gateway.relay.drain``): then the client is told.
    """
    task = asyncio.current_task()
    assert task is not None
    finished = False
    hung_up = False
    started = False

    async def listen() -> None:
        nonlocal hung_up
        # A server that fails receive() on a dead connection says the same as a disconnect.
        with contextlib.suppress(Exception):
            while (await receive())["type"] != "http.disconnect":
                pass
        # After the answer is complete, servers report a disconnect too: that one is not news.
        if not finished:
            hung_up = True
            task.cancel()

    async def tracked_send(message: Mapping[str, Any]) -> None:
        nonlocal started
        started = True
        await send(message)

    loop = asyncio.get_running_loop()
    listener: asyncio.Task[None] | None = None

    def start_listening() -> None:
        nonlocal listener
        listener = loop.create_task(listen())

    # Most answers are done before the listener would matter: it starts only if this one is
    # not, and a client that left meanwhile is told at once by its first receive().
    listen_later = loop.call_later(LISTEN_AFTER_S, start_listening)
    drain.requests.add(task)
    try:
        answer = await _answer(route, authorization, body, clock_start, session, trace=trace)
        await send_answer(answer, tracked_send)
    except asyncio.CancelledError:
        if not hung_up and not drain.cut:
            raise
        task.uncancel()  # our own cancellation: the relay has closed the upstream and recorded it
        if not hung_up:
            await _tell_cut(send, started=started)
    finally:
        finished = True
        drain.requests.discard(task)
        listen_later.cancel()
        if listener is not None:
            listener.cancel()


async def _tell_cut(send: Send, *, started: bool) -> None:
    """The stop's grace is over: end the answer with an error the client's library reads."""
    error = ApiError(
        503, "The gateway is restarting; retry the request.", "server_shutting_down", retry_after=1
    )
    with contextlib.suppress(Exception):  # the client may be gone by now as well
        if started:
            await send({"type": "http.response.body", "body": error.sse_event(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            refusal = error_response(error)
            refusal.headers.append((b"connection", b"close"))
            await send_answer(refusal, send)


# A relay request starts listening for its client's hang-up after this long (see _relay).
LISTEN_AFTER_S = 0.05

V1_URLCONF = "gateway.edge.v1_urls"

_imported: set[str] = set()
_importing: dict[str, asyncio.Future[object]] = {}


async def imported(module: str) -> None:
    """Import ``module`` in a thread, once, however many requests ask at the same time.

    The URLconfs a web process loads on first use (ninja's ``/v1`` operations, the site's
    admin) take most of a second of imports on a slow machine. Django would import them on the
    event loop, stalling every request in flight meanwhile; in a thread, the loop keeps turning.
    Once imported, what they loaded is kept out of the cyclic collector's scans.
    """
    if module in _imported:
        return
    importing = _importing.get(module)
    if importing is None:
        importing = _importing[module] = asyncio.ensure_future(
            asyncio.to_thread(importlib.import_module, module)
        )
    try:
        await asyncio.shield(importing)
    except Exception:
        _importing.pop(module, None)  # Django imports it again and answers with the error
        return
    if module not in _imported:
        _imported.add(module)
        # The process froze what it loaded at start (gateway.routing.upstreams); what came now is
        # frozen too, so that full collections do not scan it: a scan is a stall for every
        # request in flight (docs/decisions.md, 'the heap frozen out of the cyclic collector').
        gc.freeze()


async def prepare() -> None:
    """Start what a web process's first ``/v1`` request would otherwise start and wait for, as
    soon as the process serves: the routing table's first load (with this host's board and its
    other processes), the usage writer, and the store's request lane (a key lookup's query).
    A process that has served nothing is cold just when it matters: after a restart under
    load, or in a burst its host's other process took the quiet requests before
    (docs/decisions.md, '/v1 prepared at startup'). A store that does not answer now is found
    as a request would find it (the table's load says so, and keeps trying); nothing here
    stops the process serving."""
    entry.start_background()
    results = await asyncio.gather(upstreams.start(), keys.cache.prepare(), return_exceptions=True)
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, DatabaseError):
            logger.error("preparing /v1 failed", exc_info=result)


class V1App:
    """``/v1``: the relay routes here, everything else through django-ninja."""

    def __init__(self) -> None:
        self._django = _DjangoV1Handler()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        clock_start = time.perf_counter()
        if scope["type"] != "http":
            raise ValueError(f"the /v1 application serves HTTP, not {scope['type']}")
        limit = settings.LLMGW_MAX_BODY_BYTES
        authorization: bytes | None = None
        session: bytes | None = None  # x-session-id: requests that share one share a replica
        # W3C trace context: the client's trace, which this request's span joins when traced.
        traceparent: bytes | None = None
        tracestate: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-session-id":
                session = value
            elif name == b"traceparent":
                traceparent = value
            elif name == b"tracestate":  # may come in several lines: one list (RFC 9110)
                tracestate = value if tracestate is None else tracestate + b"," + value
            elif name == b"content-length" and value.isdigit() and int(value) > limit:
                await send_answer(_refused_body(), send)
                return
        try:
            body = await read_body(receive, limit)
        except RequestGone:
            return
        except BodyTooLarge:
            await send_answer(_refused_body(), send)
            return
        route = BY_PATH.get(scope["path"]) if scope["method"] == "POST" else None
        if route is not None:
            await _relay(
                route,
                authorization,
                body,
                clock_start,
                session=session,
                trace=(traceparent, tracestate),
                receive=receive,
                send=send,
            )
        elif scope["path"] == "/v1/models" and scope["method"] == "GET":
            # Clients list models often (as a health check, too): no ninja, no Django.
            await send_answer(await _models(authorization), send)
        else:
            await self._django.respond(scope, body, send)


class _DjangoV1Handler(ASGIHandler):
    """Django's ASGI handler with an empty middleware chain and no per-request signals, for the
    ninja operations that do not go to an engine."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        self._exception_middleware: list[Any] = []
        self._middleware_chain = convert_exception_to_response(
            self._get_response_async  # type: ignore[attr-defined]
        )

    async def respond(self, scope: Scope, body: bytes, send: Send) -> None:
        await imported(V1_URLCONF)
        set_script_prefix(scope.get("root_path", "") or "/")
        request = _request(scope, body)
        if request is None:
            error = ApiError(400, "The request could not be read.", "bad_request")
            await send_answer(error_response(error), send)
            return
        response = await self._middleware_chain(request)  # type: ignore[misc]
        await self.send_response(openai_shaped(response), send)


class _BytesBody:
    """The read interface ASGIRequest wants, over bytes already in memory (no temp file)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            chunk = self._data[self._pos :]
        else:
            chunk = self._data[self._pos : self._pos + size]
        self._pos += len(chunk)
        return chunk

    def readline(self, size: int = -1) -> bytes:
        end = self._data.find(b"\n", self._pos)
        end = len(self._data) if end < 0 else end + 1
        if size is not None and size >= 0:
            end = min(end, self._pos + size)
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos
        return pos

    def close(self) -> None:
        pass


def _request(scope: Scope, body: bytes) -> ASGIRequest | None:
    try:
        request = ASGIRequest(scope, _BytesBody(body))  # type: ignore[arg-type]
    except UnicodeDecodeError:
        return None
    # The body is already in memory: hand it over instead of letting Django copy it again.
    request._body = body
    request.urlconf = V1_URLCONF
    return request
