"""The held-streams load generator: one socket per stream, read by a bare protocol.

1,000 streams at 20 ms between tokens are 50,000 events a second into the load generator.
Read through aiohttp on the stock event loop, the generator's own CPU stalled the engine on its
core, and the figure measured the load generator, not the gateway (docs/decisions.md, 'the
held-streams load generator'). Here a ``asyncio.Protocol`` sees the bytes as they come and
only timestamps and counts them.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit


class HeldStream(asyncio.Protocol):
    """One streamed request: its time to first event, the longest gap between two reads that
    held events, and how many events came. Ends at the chunked body's last chunk."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.head = b""
        self.status = 0
        self.events = 0
        self.started = 0.0
        self.first = 0.0
        self.last = 0.0
        self.max_gap = 0.0
        self.tail = b""  # the end of the previous read: an event marker or the end may straddle
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.status:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self.head[9:12])
            data = self.head[end + 4 :]
            self.head = b""
        seen = self.tail + data
        count = seen.count(b"data: ") - self.tail.count(b"data: ")
        self.tail = seen[-8:]
        if count:
            self.events += count
            if self.first:
                self.max_gap = max(self.max_gap, now - self.last)
            else:
                self.first = now - self.started
            self.last = now
        if seen.endswith(b"0\r\n\r\n") or self.status != 200:
            self.finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self.finish()

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def held_stream(base_url: str, key: str, body: bytes) -> HeldStream:
    """POST ``body`` to ``/v1/chat/completions`` on a new connection and read to the end."""
    url = urlsplit(base_url)
    loop = asyncio.get_running_loop()
    _, stream = await loop.create_connection(HeldStream, url.hostname or "", url.port or 80)
    assert stream.transport is not None
    stream.started = time.perf_counter()
    stream.transport.write(
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + f"Host: {url.netloc}\r\nAuthorization: Bearer {key}\r\n".encode()
        + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        await stream.done
    finally:
        stream.finish()
    return stream
