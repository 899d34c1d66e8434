"""What the relay answers: a status, headers, and a body or a stream of chunks.

Headers are kept as ASGI sends them (lower-case names, bytes), so the ``/v1`` application
writes an answer without converting anything; ``gateway.edge.api`` adapts the same object to a
Django response for the ninja operations.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass

Header = tuple[bytes, bytes]

JSON = b"application/json"
# Proxies in front of the gateway must pass events on as they come, not collect them.
_EVENT_STREAM_HEADERS: tuple[Header, ...] = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


@dataclass(slots=True)
class Response:
    status: int
    headers: list[Header]
    body: bytes = b""
    # When set, the answer is this stream, each chunk sent as it comes; ``body`` is unused.
    stream: AsyncGenerator[bytes] | None = None
    # Work that must follow the answer but need not delay it (the request's usage record):
    # whoever writes the answer calls ``settled()`` once it is written, or failed to be.
    after: Callable[[], None] | None = None

    def settled(self) -> None:
        after, self.after = self.after, None
        if after is not None:
            after()


def whole(
    status: int,
    body: bytes,
    *,
    content_type: bytes = JSON,
    request_id: str | None = None,
    extra: Iterable[Header] = (),
) -> Response:
    """An answer whose body is all there."""
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    headers.extend(extra)
    return Response(status, headers, body)


def event_stream(stream: AsyncGenerator[bytes], request_id: str) -> Response:
    """A 200 whose body is server-sent events, relayed chunk by chunk."""
    headers = [*_EVENT_STREAM_HEADERS, (b"x-request-id", request_id.encode())]
    return Response(200, headers, stream=stream)
