"""A small HTTP/1.1 server connection on ``asyncio.Protocol``, written for speed, not breadth.

It knows keep-alive, Content-Length and chunked request bodies, ``Expect: 100-continue``,
chunked responses for SSE, bounded heads and bodies, and write back-pressure. A request that
can be answered at once is answered inside ``data_received``: no task, no extra loop turn.
Everything else runs as the connection's one task, which a client disconnect cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from email.utils import formatdate
from typing import Any, Final, cast

from agents.sim.wire import dumps, error_body

log = logging.getLogger("agents.sim")

JSON_TYPE: Final = "application/json"
SSE_TYPE: Final = "text/event-stream; charset=utf-8"
LAST_CHUNK: Final = b"0\r\n\r\n"
_PHRASES: Final = {s.value: s.phrase for s in http.HTTPStatus}


class HttpError(Exception):
    """A request answered with an error instead of a generation."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        body: bytes | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else error_body(status, message)
        self.headers = headers
        self.close = close


def detail(status: int, text: str, **kw: Any) -> HttpError:
    """FastAPI's own ``{"detail": ...}`` answer, which vLLM gives for unknown routes."""
    return HttpError(status, text, body=dumps({"detail": text}), **kw)


class _DateCache:
    """``formatdate`` costs microseconds and the Date header changes once a second."""

    second = -1
    value = ""

    @classmethod
    def get(cls) -> str:
        now = int(time.time())
        if now != cls.second:
            cls.second, cls.value = now, formatdate(now, usegmt=True)
        return cls.value


def response_head(
    status: int,
    content_type: str | None,
    length: int | None,
    keep_alive: bool,
    headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    """Status line and headers as uvicorn writes them; ``length=None`` means chunked."""
    lines = [
        f"HTTP/1.1 {status} {_PHRASES.get(status, 'Unknown')}",
        f"date: {_DateCache.get()}",
        "server: uvicorn",
        "transfer-encoding: chunked" if length is None else f"content-length: {length}",
    ]
    if content_type:
        lines.append(f"content-type: {content_type}")
    lines.extend(f"{k}: {v}" for k, v in headers)
    if not keep_alive:
        lines.append("connection: close")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")


def frame(events: Sequence[bytes]) -> bytes:
    """Each SSE event in its own HTTP chunk, as uvicorn writes a StreamingResponse."""
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


class Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "path")

    def __init__(
        self, method: str, path: str, headers: dict[str, str], body: bytes, keep_alive: bool
    ) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


class _Head:
    """A parsed request head whose body may not have fully arrived yet."""

    __slots__ = (
        "chunked",
        "continue_sent",
        "decoded",
        "headers",
        "keep_alive",
        "length",
        "method",
        "path",
    )

    def __init__(self, raw: bytes, max_body: int) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[0].isalpha():
            raise HttpError(400, "Invalid HTTP request line", close=True)
        self.method, target, version = parts
        self.path = target.partition("?")[0]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[-1] in " \t":
                raise HttpError(400, "Invalid HTTP header line", close=True)
            key = name.lower()
            if key in headers:
                if key == "content-length":
                    raise HttpError(400, "Duplicate Content-Length", close=True)
                headers[key] += ", " + value.strip()
            else:
                headers[key] = value.strip()
        self.headers = headers
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.1":
            self.keep_alive = "close" not in connection
        else:
            self.keep_alive = "keep-alive" in connection
        self.chunked = False
        self.length = 0
        encoding = headers.get("transfer-encoding")
        if encoding is not None:
            # Both framings at once is how requests get smuggled; refuse rather than guess.
            if encoding.lower() != "chunked" or "content-length" in headers:
                raise HttpError(400, "Unsupported Transfer-Encoding", close=True)
            self.chunked = True
        elif "content-length" in headers:
            text = headers["content-length"]
            if not text.isdigit():
                raise HttpError(400, "Invalid Content-Length", close=True)
            self.length = int(text)
            if self.length > max_body:
                raise HttpError(413, f"Request body exceeds {max_body} bytes", close=True)
        self.decoded = bytearray()
        self.continue_sent = False


Dispatch = Callable[["Connection", Request], None]


class Connection(asyncio.Protocol):
    """One client connection: parses requests in order and runs at most one task at a time."""

    def __init__(
        self,
        dispatch: Dispatch,
        registry: set[Connection],
        *,
        max_header_bytes: int,
        max_body_bytes: int,
    ) -> None:
        self._dispatch = dispatch
        self._registry = registry
        self._max_header = max_header_bytes
        self._max_body = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending: _Head | None = None
        self.task: asyncio.Task[None] | None = None
        self.keep_alive = True
        self.closed = False
        self.discarding = False
        self.reading_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None

    # ---- transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, but not always an asyncio.Transport subclass: uvloop's are its
        # own classes with the same methods, so check nothing here beyond the interface we use.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._registry.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._registry.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: stop generating for nobody
        self._wake_drain()

    def pause_writing(self) -> None:
        if self.drain_waiter is None:
            self.drain_waiter = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake_drain()

    def _wake_drain(self) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        """Wait while the client reads slower than we write."""
        if self.drain_waiter is not None:
            await self.drain_waiter

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        self.buf += data
        if self.task is None:
            self.serve_buffer()
        elif len(self.buf) > self._max_body and not self.reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()  # a client piling requests up behind a slow one
            self.reading_paused = True

    # ---- the request loop

    def serve_buffer(self) -> None:
        while self.task is None and not self.closed and not self.discarding:
            try:
                request = self._parse()
                if request is None:
                    return
                self.keep_alive = request.keep_alive
                self._dispatch(self, request)
            except HttpError as err:
                # close=True errors come from the parser: the rest of the input is unreadable.
                self.respond(
                    err.status, err.body, headers=err.headers, close=err.close, linger=err.close
                )
            except Exception:
                log.exception("sim: request handler failed")
                self.respond(500, error_body(500, "Internal server error"), close=True)

    def _parse(self) -> Request | None:
        buf = self.buf
        head = self.pending
        if head is None:
            while buf.startswith(b"\r\n"):  # RFC 9112: ignore empty lines before a request
                del buf[:2]
            end = buf.find(b"\r\n\r\n", 0, self._max_header + 4)
            if end < 0:
                if len(buf) > self._max_header:
                    raise HttpError(431, "Request header fields too large", close=True)
                return None
            head = _Head(bytes(buf[:end]), self._max_body)
            del buf[: end + 4]
            self.pending = head
        if head.chunked:
            if not self._take_chunks(head):
                self._maybe_continue(head)
                return None
            body = bytes(head.decoded)
        else:
            if len(buf) < head.length:
                self._maybe_continue(head)
                return None
            body = bytes(buf[: head.length])
            del buf[: head.length]
        self.pending = None
        return Request(head.method, head.path, head.headers, body, head.keep_alive)

    def _take_chunks(self, head: _Head) -> bool:
        """Move complete chunks from the buffer into the body; True once the last one is in."""
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                if len(buf) > 1024:
                    raise HttpError(400, "Invalid chunk size line", close=True)
                return False
            size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
            if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
                raise HttpError(400, "Invalid chunk size", close=True)
            size = int(size_text, 16)
            if size == 0:
                if buf[eol : eol + 4] == b"\r\n\r\n":
                    del buf[: eol + 4]
                    return True
                end = buf.find(b"\r\n\r\n", eol)  # trailer fields, ended by an empty line
                if end < 0:
                    return False
                del buf[: end + 4]
                return True
            if len(buf) < eol + 4 + size:
                return False
            if buf[eol + 2 + size : eol + 4 + size] != b"\r\n":
                raise HttpError(400, "Invalid chunk framing", close=True)
            head.decoded += buf[eol + 2 : eol + 2 + size]
            if len(head.decoded) > self._max_body:
                raise HttpError(413, f"Request body exceeds {self._max_body} bytes", close=True)
            del buf[: eol + 4 + size]

    def _maybe_continue(self, head: _Head) -> None:
        if not head.continue_sent and head.headers.get("expect", "").lower() == "100-continue":
            head.continue_sent = True
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # ---- writing

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def respond(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str | None = JSON_TYPE,
        headers: Sequence[tuple[str, str]] = (),
        close: bool = False,
        linger: bool = False,
    ) -> None:
        if close:
            self.keep_alive = False
        self.write(response_head(status, content_type, len(body), self.keep_alive, headers) + body)
        self.finish(linger=linger)

    def start_stream(self) -> None:
        self.write(response_head(200, SSE_TYPE, None, self.keep_alive))

    def finish(self, *, linger: bool = False) -> None:
        """After a complete response: keep the connection, or close it politely."""
        if self.keep_alive or self.transport is None or self.closed:
            return
        if linger:
            # Answered before the request body was read (413, 400): swallow what the client is
            # still sending for a moment, or the kernel resets the socket and eats our answer.
            self.discarding = True
            self.pending = None
            self.buf.clear()
            asyncio.get_running_loop().call_later(1.0, self.transport.close)
            with contextlib.suppress(RuntimeError, OSError):
                self.transport.write_eof()
            return
        self.transport.close()

    def cut(self) -> None:
        """Die after the first byte: no terminating chunk, no complete body, just a FIN."""
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run the rest of this request as the connection's task; parsing waits for it."""
        self.task = asyncio.get_running_loop().create_task(coro)
        self.task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("sim: generation failed", exc_info=task.exception())
            self.cut()
            return
        if self.closed:
            return
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        self.serve_buffer()
