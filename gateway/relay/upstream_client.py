"""The relay's HTTP/1.1 client for engines and static endpoints: pooled keep-alive connections,
one write per request, responses parsed by httptools (llhttp, the parser under Node.js).

It does only what a relay needs: POST a body, read the status and headers, then the body whole
or piece by piece as it arrives. No redirects, cookies, proxies, compression or retries of its
own (``gateway.relay.attempts`` decides retries, per phase deadlines and ejections). Chosen
over aiohttp by measurement, side by side in one relay: less CPU per request and less added
latency (docs/decisions.md, 'upstream client').

Connections get ``TCP_NODELAY`` (small SSE events are not held back by Nagle's algorithm),
idle ones are reused for ``keepalive_s`` (sooner than engines close them: uvicorn, under vLLM
and SGLang, closes an idle connection after 5 s), host names are resolved at most once a
minute, and a stream's connection stops reading while the client has not taken what was read
(so a slow client holds back the engine instead of growing this process's memory).

Every call, relayed or the gateway's own (token counting, the context-length probe), names the
``Upstream`` it goes to (``Pool.post`` is the one way in) and gets from it what no caller may
forget: the engine's key on the request and the addresses a connection may reach. A connection
is checked against that policy when it is opened, so it is kept for requests under the same
policy only: one opened for a node's engine (where loopback may be normal) never carries an
Endpoint row's request to the same origin.

It imports nothing of Django's, so a benchmark's floor can use the very same client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.addresses import AddressPolicy, address_problem
from gateway.routing.table import Upstream

# Stop reading from an upstream while this much of its answer waits for the client.
HIGH_WATER = 256 * 1024
DNS_TTL_S = 60.0


class UpstreamError(Exception):
    """The upstream failed below HTTP: nothing came back that can be relayed."""


class Unreachable(UpstreamError):
    """No connection could be made (refused, unroutable, name unknown, connect deadline)."""


class Forbidden(Unreachable):
    """The upstream's address is one this upstream may not reach (see AddressPolicy)."""


class Dropped(UpstreamError):
    """A reused connection was closed before any byte of an answer: almost always one the
    upstream closed while it was idle, which says nothing about the upstream's health."""


class Broken(UpstreamError):
    """The connection failed or the answer was malformed after the request was sent."""


@dataclass(frozen=True)
class Origin:
    """Where a base URL's requests go, and what they carry of it."""

    scheme: str
    host: str
    port: int
    host_header: bytes
    path_prefix: bytes  # a static endpoint may sit under a path: https://host/openai

    @classmethod
    def of(cls, base_url: str) -> Origin:
        try:
            parts = urlsplit(base_url)
            scheme = parts.scheme or "http"
            default_port = 443 if scheme == "https" else 80
            port = parts.port or default_port
            host = parts.hostname or ""
            shown = f"[{host}]" if ":" in host else host
            if not shown.isascii():
                shown = shown.encode("idna").decode("ascii")
            header = shown if port == default_port else f"{shown}:{port}"
            prefix = parts.path.rstrip("/").encode("ascii")
        except (ValueError, UnicodeError) as exc:
            raise Unreachable(f"not a usable upstream URL ({exc})") from None
        return cls(scheme, host, port, header.encode("ascii"), prefix)


class Response:
    """One upstream answer. Read it whole or in pieces; then ``release()`` it (the connection
    goes back to the pool if the answer was complete) or ``close()`` it (the connection is
    dropped, which tells the engine to stop)."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: dict[bytes, bytes] = {}  # lower-case names; the last value of a repeat
        self.complete = False
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wait_deadline = 0.0
        self._watchdog: asyncio.TimerHandle | None = None

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    async def read_piece(self, idle: float | None = None) -> bytes:
        """What of the body has arrived since the last call (waiting for some if nothing
        has); ``b""`` once the body is complete. Pieces that came together are returned
        together: they were all there, so joining them delays nothing.

        ``idle``: ``TimeoutError`` once this call has waited that long for a piece. Only the
        wait counts: time the caller spends between calls (a slow client) is not the
        upstream's."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            if idle is not None:
                self._wait_deadline = loop.time() + idle
                if self._watchdog is None:
                    self._watchdog = loop.call_at(self._wait_deadline, self._watch)
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        piece = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if self._buffered >= HIGH_WATER:
            self._connection.resume()
        self._buffered = 0
        return piece

    async def read(self) -> bytes:
        """The rest of the body."""
        pieces = []
        while piece := await self.read_piece():
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def release(self) -> None:
        self._stop_watch()
        self._connection.finished(self, reuse=self.complete)

    def close(self) -> None:
        self._stop_watch()
        self._connection.finished(self, reuse=False)

    def _watch(self) -> None:
        """The idle deadline's one timer. It is moved on to the current wait's deadline when
        it fires early, not set and cancelled for every piece: ``asyncio.timeout`` around each
        read was a tenth of a relayed stream's CPU."""
        self._watchdog = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits now; the next wait arms it again
        loop = asyncio.get_running_loop()
        if loop.time() >= self._wait_deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._watchdog = loop.call_at(self._wait_deadline, self._watch)

    def _stop_watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    # --- called by the connection ---------------------------------------------------------

    def _got_head(self, status: int) -> None:
        self.status = status
        if not self._head.done():
            self._head.set_result(None)

    def _got_piece(self, piece: bytes) -> None:
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered >= HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _got_end(self) -> None:
        self.complete = True
        self._wake()

    def _failed(self, error: UpstreamError) -> None:
        if self.complete:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one origin, carrying one request at a time, opened (and so
    reused) under one address policy."""

    def __init__(self, pool: Pool, origin: Origin, policy: AddressPolicy) -> None:
        self._pool = pool
        self.origin = origin
        self.policy = policy
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.used = False  # has carried a request before the current one
        self._response: Response | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._body_until_eof = False
        self._keep_alive = False  # what the current answer's head said

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses, so no isinstance).
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._response is None:
            self._abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Broken(f"the upstream's answer is not valid HTTP ({exc})"))

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and not response.complete:
            if response.status and self._body_until_eof and exc is None:
                response._got_end()  # a body without a length ends where the connection does
            elif not response.status and self.used and not response._pieces:
                response._failed(Dropped("the upstream closed an idle connection"))
            else:
                response._failed(Broken("the upstream closed the connection mid-answer"))
        self._pool.forget(self)

    # --- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        # One answer per request: a second one (or bytes after the first) means the stream
        # cannot be trusted. Raising here makes feed_data fail, which drops the connection.
        if self._response is None or self._response.status:
            raise Broken("the upstream sent an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            return
        status = self._parser.get_status_code()
        if status < 200:
            # Nothing here sends Expect or upgrades; an interim answer means a confused peer.
            self._fail(Broken(f"the upstream sent an interim {status} answer"))
            return
        headers = response.headers
        self._body_until_eof = (
            b"content-length" not in headers and b"transfer-encoding" not in headers
        )
        # Asked here: once the message is complete the parser has already moved on.
        self._keep_alive = self._parser.should_keep_alive()
        response._got_head(status)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._got_piece(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response._got_end()

    # --- used by the pool and the response ---------------------------------------------------

    def send(self, head: bytes, body: bytes) -> Response:
        assert self.transport is not None
        response = Response(self)
        self._response = response
        self._body_until_eof = False
        self._keep_alive = False
        if len(body) <= 65536:
            self.transport.write(head + body)  # one segment for a typical request
        else:
            self.transport.writelines((head, body))
        return response

    def finished(self, response: Response, *, reuse: bool) -> None:
        if response is not self._response:
            return  # released twice, or after the connection moved on
        self._response = None
        if reuse and not self.closed and self._keep_alive:
            self.resume()
            self.used = True
            self._parser = httptools.HttpResponseParser(self)
            self._pool.idle(self)
        else:
            self._abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _fail(self, error: UpstreamError) -> None:
        if self._response is not None:
            self._response._failed(error)
        self._abort()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """Keep-alive connections per origin and address policy, for one event loop."""

    def __init__(
        self,
        *,
        keepalive_s: float,
        resolver: Callable[[str, int], Awaitable[list[str]]] | None = None,
    ) -> None:
        self.keepalive_s = keepalive_s
        self._resolver = resolver or _getaddrinfo
        self._idle: dict[tuple[Origin, AddressPolicy], list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._addresses: dict[tuple[str, int], tuple[str, float]] = {}
        self._tls: ssl.SSLContext | None = None
        self._open: set[_Connection] = set()

    async def post(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        headers: bytes,
        *,
        connect_timeout: float,
        method: bytes = b"POST",
    ) -> Response:
        """Send ``POST path`` (or ``method``) with ``body`` to ``upstream`` and return once the
        answer's status and headers are in. ``headers`` are complete header lines
        (``Name: value\\r\\n``) without Host, Content-Length and Authorization: the engine's key
        is the upstream's to add. A connection is made, or reused, only under the upstream's
        address policy. Raises ``Unreachable`` (``Forbidden``), ``Dropped`` or ``Broken``."""
        origin = self._origins.get(upstream.base_url)
        if origin is None:
            origin = self._origins[upstream.base_url] = Origin.of(upstream.base_url)
        policy = AddressPolicy(upstream.addresses)
        connection = self._reuse(origin, policy) or await self._connect(
            origin, connect_timeout, policy
        )
        head = b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%s%sContent-Length: %d\r\n\r\n" % (
            method,
            origin.path_prefix,
            path.encode(),
            origin.host_header,
            headers,
            upstream.authorization,
            len(body),
        )
        try:
            response = connection.send(head, body)
        except (OSError, RuntimeError):  # closed under us (uvloop raises on a closed handle)
            connection._abort()
            if connection.used:
                raise Dropped("the upstream closed an idle connection") from None
            raise Broken("the connection closed as the request was sent") from None
        try:
            await response._head
        except BaseException:
            response.close()
            raise
        return response

    def _reuse(self, origin: Origin, policy: AddressPolicy) -> _Connection | None:
        idle = self._idle.get((origin, policy))
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            transport = connection.transport
            if connection.closed or transport is None or transport.is_closing():
                continue
            if now - connection.idle_since >= self.keepalive_s:
                connection._abort()
                continue
            return connection
        return None

    async def _connect(
        self, origin: Origin, deadline_s: float, policy: AddressPolicy
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self, origin, policy)
        tls = self._tls_context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(deadline_s):
                address = await self._resolve(origin)
                # The address the socket will connect to, not the URL's text, is what counts.
                problem = address_problem(address, policy)
                if problem is not None:
                    raise Forbidden(f"{origin.host} resolves to {problem}; not connecting")
                await loop.create_connection(
                    lambda: connection,
                    address,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        self._open.add(connection)
        return connection

    async def _resolve(self, origin: Origin) -> str:
        key = (origin.host, origin.port)
        cached = self._addresses.get(key)
        now = time.monotonic()
        if cached is not None and now < cached[1]:
            return cached[0]
        addresses = await self._resolver(origin.host, origin.port)
        if not addresses:
            raise OSError(f"no address for {origin.host}")
        address = addresses[0]
        self._addresses[key] = (address, now + DNS_TTL_S)
        return address

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    # --- called by connections ------------------------------------------------------------

    def idle(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault((connection.origin, connection.policy), []).append(connection)

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get((connection.origin, connection.policy))
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        """Drop every connection (at exit, or when the loop this pool belongs to is gone)."""
        for connection in list(self._open):
            connection._abort()
        self._open.clear()
        self._idle.clear()


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def header_lines(headers: dict[str, str]) -> bytes:
    """Fixed request headers, encoded once for ``Pool.post``."""
    return b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())
