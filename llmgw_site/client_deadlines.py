"""Deadlines for slow clients: a request's headers must have arrived ``LLMGW_HEADER_TIMEOUT``
seconds after its connection opened (or, on a kept-alive connection, after its first byte), and
its body ``LLMGW_BODY_TIMEOUT`` seconds after its headers. Past either, the client is answered
408 and the connection closed.

uvicorn has only a keep-alive timeout, armed once an answer is complete: a connection that
trickles its headers a byte a second (slowloris), or sends whole headers and then its body that
slowly, is kept for as long as the client likes, each holding a socket, its buffers and, for a
body, a task of the application waiting in ``receive()``. An idle deadline (reset by every byte,
as nginx's are) would never fire for such a client; these are deadlines on the whole phase.

The body deadline is the server's, not the application's, so it holds for every route of every
listener (``/v1`` reads its body in ``gateway.edge.asgi.read_body``, the admin in Django's
handler) the same way. When it passes, the application is told the client has gone (its
``receive()`` says ``http.disconnect``, as for a client that hung up) and its answer, if it
still writes one, goes nowhere; the 408 is written here. A WebSocket handshake has its headers
deadline; once upgraded, the stream's own pings apply.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    IDLE = "idle"  # between requests: uvicorn's keep-alive timeout applies
    HEADERS = "headers"
    BODY = "body"


def _answer_408(phase: Phase) -> bytes:
    body = (
        b'{"error": {"message": "The request\'s %s did not arrive in time.", '
        b'"type": "invalid_request_error", "code": "request_timeout"}}' % phase.value.encode()
    )
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers and body.

    The phase changes in the parser's callbacks; the body deadline is armed after a read leaves
    a request in its body, so a request whose body came with its headers (most) never arms one.
    """

    header_timeout = 10.0
    body_timeout = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = Phase.IDLE
        self._deadline: asyncio.TimerHandle | None = None
        self._due = 0.0  # time.monotonic() when the armed deadline passes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A new connection owes its first request's headers from now, even if it sends nothing.
        self._phase = Phase.HEADERS
        self._arm(self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Not while uvicorn has stopped reading (a request pipelined behind one still being
        # answered): then the body waits on the server, not on the client.
        if self._phase is Phase.BODY and self._deadline is None and not self.flow.read_paused:
            self._arm(self.body_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase is Phase.IDLE:
            # A kept-alive connection: its keep-alive wait is over, its headers owe from now.
            self._phase = Phase.HEADERS
            self._arm(self.header_timeout)

    def on_headers_complete(self) -> None:
        self._disarm()
        # Until the message is complete; a WebSocket handshake is complete with its headers
        # (the parser says so before it hands the connection over), so no stream gets a body
        # deadline.
        self._phase = Phase.BODY
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._phase = Phase.IDLE
        super().on_message_complete()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._due = time.monotonic() + seconds
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        early_by = self._due - time.monotonic()
        if early_by > 0:
            # uvloop's timers count whole milliseconds (the delay rounded, the clock truncated),
            # so one fires up to a millisecond before its time; the deadline is a promise to
            # the client (never closed before it): wait out the rest.
            self._deadline = self.loop.call_later(early_by + 0.001, self._expired)
            return
        self._deadline = None
        phase, self._phase = self._phase, Phase.IDLE
        if self.transport.is_closing() or phase is Phase.IDLE:
            return
        # Imported here: prometheus_client must not load before the settings have named its
        # multiprocess folder, and this module loads with the server, before the application.
        from telemetry import metrics  # noqa: PLC0415 - see above

        metrics.SLOW_CLIENTS_CLOSED.labels(phase.value).inc()
        logger.debug("closing a connection whose request's %s missed its deadline", phase.value)
        cycle = self.cycle
        # An answer under way (the application answered before the body was in, or a client
        # pipelined this request behind a stream) cannot be followed by a 408: only closed.
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if phase is Phase.BODY and cycle is not None:
            # The application waits in receive(): it hears what a hang-up would tell it, and
            # whatever it still sends is dropped (uvicorn writes nothing once disconnected).
            cycle.disconnected = True
            cycle.message_event.set()
        if not answering:
            self.transport.write(_answer_408(phase))
        self.transport.close()


def protocol(header_timeout: float, body_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's ``http`` setting, with these deadlines (seconds)."""

    class Configured(DeadlineProtocol):
        pass

    Configured.header_timeout = header_timeout
    Configured.body_timeout = body_timeout
    return Configured
