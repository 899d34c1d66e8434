"""The ASGI handler that serves ``/v1``: Django's, without the middleware and request signals.

Under ASGI each of Django's stock middleware (sessions, CSRF, auth, messages) and the
``request_started``/``request_finished`` signals (``close_old_connections``) costs a hop to a
worker thread and back. ``/v1`` uses none of them — it authenticates bearer keys itself and
touches the database only off the request path, in its own thread, retiring stale connections
there — so this handler runs the URL resolver and the view directly on the event loop, and
for the five routes that go to an engine calls the relay without a Django request at all.
Measured with ``make bench`` (target ``L2-stock-handler``): the stock handler with the
middleware costs ~4 ms more CPU per request on this machine (7.1-8.4 ms against 3.0-3.3 ms,
before the relay fast path), mostly the thread hops.
``llmgw_site.asgi`` sends paths under ``/v1/`` here and everything else (the admin) to the
stock handler.

It also refuses a body over ``LLMGW_MAX_BODY_BYTES`` with 413 as soon as its declared length
(or, for chunked uploads, the bytes received so far) passes the limit, instead of spooling it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from daphne.http_protocol import WebRequest
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler, ASGIRequest
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpResponse
from django.http.response import HttpResponseBase
from django.urls import set_script_prefix

from gateway import keys, proxy
from gateway.errors import ApiError, error_body, invalid_key

Scope = dict[str, Any]
Receive = Any
Send = Any


# The five routes that go to an engine. They are documented and implemented as django-ninja
# operations (gateway.api), but the handler calls the same function ninja's views call without
# building a Django request, resolving the URL or running ninja's operation machinery: measured
# in-process (bench/ setup, out-of-process sim) at ~250 us of CPU saved per request,
# a quarter of the total. Every other /v1 path goes through ninja.
RELAY_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/rerank": "rerank",
}


async def _fast_relay(scope: Scope, body: bytes, kind: str, clock_start: float) -> HttpResponseBase:
    authorization = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            authorization = value.decode("latin-1")
            break
    try:
        key = await keys.authenticate(authorization)
    except ApiError as error:
        return proxy.error_response(error)
    if key is None:
        return proxy.error_response(invalid_key())
    return await proxy.relay(body, key, kind, clock_start)


class BodyTooLarge(Exception):
    pass


class RequestGone(Exception):
    pass


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send: Send, error: ApiError) -> None:
    body = error.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.response_headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def too_large() -> ApiError:
    limit = int(settings.LLMGW_MAX_BODY_BYTES)
    return ApiError(413, f"The request body is larger than {limit} bytes.", "request_too_large")


class GatewayHandler(ASGIHandler):
    """Django's ASGI handler with an empty middleware chain and no per-request signals."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        self._exception_middleware: list[Any] = []
        self._middleware_chain = convert_exception_to_response(
            self._get_response_async  # type: ignore[attr-defined]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the /v1 handler serves HTTP, not {scope['type']}")
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        clock_start = time.perf_counter()
        limit = int(settings.LLMGW_MAX_BODY_BYTES)
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await _send_error(send, too_large())
            return
        try:
            body = await self._read_limited(receive, limit)
        except RequestGone:
            return
        except BodyTooLarge:
            await _send_error(send, too_large())
            return
        kind = RELAY_ROUTES.get(scope["path"]) if scope["method"] == "POST" else None

        async def respond() -> None:
            if kind is not None:
                response = await _fast_relay(scope, body, kind, clock_start)
            else:
                response = await self._through_ninja(scope, body, clock_start)
            # A client that goes away while we send cancels this task; nothing is left to do.
            with contextlib.suppress(asyncio.CancelledError):
                await self.send_response(response, send)

        # As Django does: a disconnect while the view runs cancels it, which is how a client
        # that hangs up stops the upstream request (gateway.proxy closes it on cancellation).
        listener = asyncio.create_task(self._disconnected(receive))
        responder = asyncio.create_task(respond())
        await asyncio.wait((listener, responder), return_when=asyncio.FIRST_COMPLETED)
        for task in (listener, responder):
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RequestGone):
                await task

    async def send_response(self, response: HttpResponseBase, send: Send) -> None:
        """Django's, except for the relay's SSE streams, whose chunks go out as they come:
        Django's streaming wrapper (a generator mapping every chunk through ``make_bytes``,
        then re-chunking it) costs a few microseconds per event for nothing here."""
        stream = getattr(response, "llmgw_stream", None)
        if stream is None:
            await super().send_response(response, send)
            return
        headers = [(k.encode("ascii"), v.encode("latin-1")) for k, v in response.items()]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        async with contextlib.aclosing(stream) as parts:
            async for part in parts:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _through_ninja(
        self, scope: Scope, body: bytes, clock_start: float
    ) -> HttpResponseBase:
        set_script_prefix(scope.get("root_path", "") or "/")
        request = _request(scope, body)
        if request is None:
            return proxy.error_response(
                ApiError(400, "The request could not be read.", "bad_request")
            )
        request.llmgw_clock_start = clock_start  # type: ignore[attr-defined]
        response = await self._middleware_chain(request)  # type: ignore[misc]
        return _openai_shaped(response)

    async def _read_limited(self, receive: Receive, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestGone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge
                parts.append(chunk)
            if not message.get("more_body", False):
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _disconnected(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestGone


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
    return request


def _openai_shaped(response: HttpResponseBase) -> HttpResponseBase:
    """Django's own 404/405 pages (unknown path, wrong method) as OpenAI-shaped errors."""
    if response.status_code not in (404, 405):
        return response
    if response.get("Content-Type", "").startswith("application/json"):
        return response
    if response.status_code == 404:
        body = error_body("Unknown API path.", "invalid_request_error", "unknown_url")
    else:
        body = error_body(
            "Method not allowed for this path.", "invalid_request_error", "method_not_allowed"
        )
    shaped = HttpResponse(body, status=response.status_code, content_type="application/json")
    if "Allow" in response:
        shaped["Allow"] = response["Allow"]
    return shaped


def by_path(prefix: str, matched: Any, other: Any) -> Any:
    """An ASGI app sending paths under ``prefix`` to ``matched`` and the rest to ``other``."""
    bare = prefix.rstrip("/")

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path.startswith(prefix) or path == bare:
            await matched(scope, receive, send)
        else:
            await other(scope, receive, send)

    return dispatch


def install_daphne_body_limit() -> None:
    """Make daphne refuse an oversized ``/v1`` body while it is still arriving.

    Daphne (Twisted) reads the whole body into memory or a temporary file before the ASGI app
    is called at all, so the check in ``GatewayHandler`` alone would answer 413 only after the
    upload finished. Twisted tells the request its declared length as soon as the headers are
    in (``gotLength``) and hands it each piece of body (``handleContentChunk``); refusing there
    answers 413 at once for a declared length and mid-upload for a chunked one, and memory
    stays bounded either way. Other paths (the admin) keep daphne's own behaviour.
    """
    if getattr(WebRequest, "_llmgw_body_limit", False):
        return
    got_length = WebRequest.gotLength
    handle_chunk = WebRequest.handleContentChunk

    def refuse(request: Any) -> None:
        request._llmgw_refused = True
        body = too_large().body()
        request.channel.transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        request.channel.loseConnection()

    def guarded_got_length(request: Any, length: int | None) -> None:
        # The request line is parsed before the headers, so the path is known here.
        path = getattr(request.channel, "_path", b"/v1/")
        request._llmgw_guard = path.startswith(b"/v1/")
        request._llmgw_seen = 0
        request._llmgw_refused = False
        if request._llmgw_guard and length is not None and length > settings.LLMGW_MAX_BODY_BYTES:
            got_length(request, 0)
            refuse(request)
            return
        got_length(request, length)

    def guarded_chunk(request: Any, data: bytes) -> None:
        if getattr(request, "_llmgw_refused", False):
            return
        if getattr(request, "_llmgw_guard", False):
            request._llmgw_seen += len(data)
            if request._llmgw_seen > settings.LLMGW_MAX_BODY_BYTES:
                refuse(request)
                return
        handle_chunk(request, data)

    WebRequest.gotLength = guarded_got_length
    WebRequest.handleContentChunk = guarded_chunk
    WebRequest._llmgw_body_limit = True
