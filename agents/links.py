"""The agent's end of a stream, whichever transport carries it.

:class:`Link` is what :class:`agents.agent.Agent` talks through: JSON text frames of
:mod:`agents.protocol` in and out, and a close code at the end. Two transports give one:

- WebSocket (``ws://`` / ``wss://``): passes any HTTP/1.1 proxy; the node token at the
  handshake.
- gRPC (``grpc://`` / ``grpcs://``, or an ``http(s)://`` address with ``--transport grpc``): one
  bidirectional stream over HTTP/2; with a client certificate (mutual TLS) the certificate is
  the node's identity and no token is needed.

Where a link goes is checked before anything is sent: a URL without TLS is refused unless its
host is loopback or the operator said ``--insecure``, because the stream carries the node's
credentials and the commands its engines run with.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlsplit, urlunsplit

import grpc
from websockets.exceptions import ConnectionClosed

from agents import grpc_wire
from agents.protocol.vocabulary import STREAM_PATH

WEBSOCKET: Final = "websocket"
GRPC: Final = "grpc"
TRANSPORTS: Final = (WEBSOCKET, GRPC)


class LinkClosed(Exception):
    """The stream ended (closed by either side, or lost)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class Refused(Exception):
    """The control plane refused this agent before the stream began (credentials)."""


class Unreachable(Exception):
    """No stream could be opened (connection refused, TLS failed, timed out)."""


class Link(Protocol):
    async def send(self, text: str) -> None: ...

    async def recv(self) -> str | bytes:
        """The next frame; raises :class:`LinkClosed` when the stream has ended."""

    async def close(self, code: int, reason: str) -> None: ...

    @property
    def close_code(self) -> int | None: ...

    @property
    def close_reason(self) -> str: ...

    def local_address(self) -> str | None:
        """The address this node reached the control plane from, when the transport knows."""


@dataclass(frozen=True)
class Target:
    """Where one control plane is, and how to reach it."""

    transport: str
    url: str  # ws(s)://host:port/path for WebSocket, grpc(s)://host:port for gRPC
    host: str
    tls: bool

    @property
    def authority(self) -> str:
        return urlsplit(self.url).netloc


@dataclass(frozen=True)
class TlsFiles:
    """The cluster CA to trust, and this node's certificate and key (mutual TLS)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        def load(path: Path | None) -> bytes | None:
            return None if path is None else path.read_bytes()

        return load(self.ca), load(self.key), load(self.cert)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_target(url: str, transport: str, *, insecure: bool = False) -> Target:
    """A control-plane address as given on the command line, checked: the scheme fits the
    transport, and a link without TLS only goes to loopback unless ``insecure``."""
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    if not host or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s)://, ws(s):// or grpc(s):// URL")
    scheme = parts.scheme
    if transport == WEBSOCKET:
        scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
        if scheme not in ("ws", "wss"):
            raise ValueError(f"{url!r} is not an http(s):// or ws(s):// URL")
        path = parts.path if parts.path not in ("", "/") else STREAM_PATH
        target = Target(
            WEBSOCKET,
            urlunsplit((scheme, parts.netloc, path, parts.query, "")),
            host,
            scheme == "wss",
        )
    elif transport == GRPC:
        scheme = {"http": "grpc", "https": "grpcs"}.get(scheme, scheme)
        if scheme not in ("grpc", "grpcs"):
            raise ValueError(f"{url!r} is not an http(s):// or grpc(s):// URL")
        if parts.port is None:
            raise ValueError(f"{url!r}: give the agent listener's port (host:port)")
        target = Target(GRPC, f"{scheme}://{parts.netloc}", host, scheme == "grpcs")
    else:
        raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    if not target.tls and not is_loopback(host) and not insecure:
        raise ValueError(
            f"{url!r} has no TLS: the node's credentials and the commands its engines run "
            "with would cross the network in clear. Use https://, wss:// or grpcs:// "
            "(or --insecure on a network you trust)"
        )
    return target


# --------------------------------------------------------------------------- WebSocket


class WebSocketLink:
    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, text: str) -> None:

        try:
            await self.ws.send(text)
        except ConnectionClosed as exc:
            raise LinkClosed(str(exc), self.ws.close_code) from None

    async def recv(self) -> str | bytes:

        try:
            data: str | bytes = await self.ws.recv()
        except ConnectionClosed as exc:
            raise LinkClosed(str(exc), self.ws.close_code) from None
        return data

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)

    @property
    def close_code(self) -> int | None:
        code = self.ws.close_code
        return None if code is None else int(code)

    @property
    def close_reason(self) -> str:
        return str(self.ws.close_reason or "")

    def local_address(self) -> str | None:
        local: Any = self.ws.local_address
        if isinstance(local, tuple) and local and isinstance(local[0], str):
            return local[0]
        return None


# --------------------------------------------------------------------------- gRPC

# How long a closing agent waits for the control plane to end the call it half-closed.
CLOSE_TIMEOUT_S: Final = 2.0
# gRPC status codes a refusal at the start of a stream comes with.
_REFUSALS: Final = ("UNAUTHENTICATED", "PERMISSION_DENIED")


class GrpcLink:
    """One ``AgentPlane/Stream`` call. Frames are converted to and from the protocol's JSON
    text here, so the agent (and the control plane's session) see one shape.

    The call is read by a task of the link's own: in grpc.aio, cancelling a pending
    ``read()`` cancels the whole call, and the agent cancels its receiver whenever it stops,
    which would drop the last status it had just written."""

    def __init__(self, channel: Any, call: Any, *, write_timeout: float) -> None:
        self.channel = channel
        self.call = call
        # A write that does not complete in this long means the call is dead. Seen under load:
        # after a control plane's stop closed the connection, grpc.aio left this side's pending
        # write and half-close waiting for ever, and the agent with them, instead of failing.
        self.write_timeout = write_timeout
        self._close_code: int | None = None
        self._close_reason = ""
        self._closed = False
        self._channel_closing: asyncio.Future[Any] | None = None
        self._frames: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read_all(), name="grpc-read")

    async def _read_all(self) -> None:
        try:
            while True:
                frame = await self.call.read()
                self._frames.put_nowait(frame)
                if frame is grpc.aio.EOF:
                    return
        except Exception as exc:  # whatever ended the reading ends the stream for recv()
            self._frames.put_nowait(exc)

    async def send(self, text: str) -> None:
        if self._closed:
            raise LinkClosed("the stream is closing", self._close_code)
        frame = grpc_wire.text_to_frame(text, grpc_wire.AgentFrame)
        try:
            await asyncio.wait_for(self.call.write(frame), timeout=self.write_timeout)
        except TimeoutError:
            raise LinkClosed(
                f"a write did not complete within {self.write_timeout:g}s", self._close_code
            ) from None
        except (
            grpc.aio.AioRpcError,
            grpc.aio.UsageError,
            RuntimeError,
            asyncio.InvalidStateError,  # a write racing the half-close of close()
        ) as exc:
            await self._ended()
            raise LinkClosed(f"stream ended: {exc}", self._close_code) from None

    async def recv(self) -> str | bytes:
        item = await self._frames.get()
        if isinstance(item, Exception) or item is grpc.aio.EOF:
            self._frames.put_nowait(item)  # the end stays the end for every later call
            await self._ended()
        if isinstance(item, grpc.aio.AioRpcError):
            if item.code().name in _REFUSALS and self._close_code is None:
                raise Refused(f"{item.code().name}: {item.details()}")
            raise LinkClosed(
                f"{item.code().name}: {item.details() or 'no details'}", self._close_code
            )
        if isinstance(item, Exception):
            raise LinkClosed(f"reading the stream failed: {item!r}", self._close_code)
        if item is grpc.aio.EOF:
            raise LinkClosed("the control plane ended the stream", self._close_code)
        return grpc_wire.frame_to_text(item)

    async def _ended(self) -> None:
        """Read the close code the control plane left in the trailing metadata (bounded: a
        dead call may never give it)."""
        with contextlib.suppress(Exception):
            trailing = await asyncio.wait_for(self.call.trailing_metadata(), CLOSE_TIMEOUT_S)
            for key, value in trailing or ():
                if key == grpc_wire.CLOSE_CODE_KEY:
                    self._close_code = int(value)
            details = await asyncio.wait_for(self.call.details(), CLOSE_TIMEOUT_S)
            self._close_reason = str(details or "")

    async def close(self, code: int, reason: str) -> None:
        self._close_code = self._close_code or code
        self._close_reason = self._close_reason or reason
        if self._closed:
            return
        self._closed = True
        if not self.call.done():
            # Half-close, then let the control plane read what was sent (the last status
            # before a shutdown) and end the call; cancelling at once could drop it, as a
            # WebSocket close without its handshake would. Each step is bounded: on a dead
            # call none of them may ever complete.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.call.done_writing(), timeout=CLOSE_TIMEOUT_S)
            await asyncio.wait({self._reader}, timeout=CLOSE_TIMEOUT_S)
        self._reader.cancel()
        self.call.cancel()
        # The reader must have stopped before the channel closes: grpc.aio orphans the TCP
        # connection of a channel closed while a read of its call is still being cancelled
        # (grpc/grpc#42125), and a revoked agent kept its connection open that way.
        await asyncio.wait({self._reader}, timeout=CLOSE_TIMEOUT_S)
        # Shielded: a close cut short by the bound would leave the connection open (a loaded
        # machine took longer than the bound once), so it goes on after the agent moves on;
        # the link keeps the task, which asyncio itself holds only weakly.
        self._channel_closing = asyncio.ensure_future(self.channel.close(grace=None))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._channel_closing), timeout=CLOSE_TIMEOUT_S)
        self._release_call()

    def _release_call(self) -> None:
        """Let go of the call now. grpc.aio tears a channel's connection down only once its
        last call object is freed, and the link's reference cycles (a read's exception and its
        traceback hold the call) wait for the garbage collector, which an agent sleeping out
        a long backoff may not run for minutes: a revoked agent kept its connection open."""
        self.call = None
        self._frames = asyncio.Queue()
        self._frames.put_nowait(grpc.aio.EOF)  # the end stays the end for a later recv()
        gc.collect()  # cycles inside grpc.aio that hold the call (one per disconnect: cheap)

    @property
    def close_code(self) -> int | None:
        return self._close_code

    @property
    def close_reason(self) -> str:
        return self._close_reason

    def local_address(self) -> str | None:
        return None  # gRPC does not say; the agent resolves its address before it dials


def grpc_channel(
    target: Target, tls: TlsFiles, *, keepalive_s: float, max_message_bytes: int
) -> Any:
    """A channel to the agent listener: TLS (verifying the server against ``tls.ca``, and
    presenting this node's certificate when it has one), or plaintext to loopback."""

    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Pings find a half-open connection (no FIN, no RST), as WebSocket pings do.
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # One try per connect: the agent's own backoff decides when to try again.
        ("grpc.enable_retries", 0),
        ("grpc.enable_http_proxy", 0),
        # The channel owns its connection: one channel per connection attempt, and closing it
        # closes the connection (the process-wide pool may keep a closed channel's open).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if not target.tls:
        return grpc.aio.insecure_channel(target.authority, options=options)
    ca, key, cert = tls.read()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return grpc.aio.secure_channel(target.authority, credentials, options=options)


async def open_grpc(
    target: Target,
    tls: TlsFiles,
    metadata: tuple[tuple[str, str], ...],
    *,
    open_timeout: float,
    keepalive_s: float,
    max_message_bytes: int,
    write_timeout: float,
) -> GrpcLink:

    channel = grpc_channel(
        target, tls, keepalive_s=keepalive_s, max_message_bytes=max_message_bytes
    )
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=open_timeout)
    except (TimeoutError, asyncio.CancelledError):
        await channel.close(grace=None)
        raise Unreachable(f"no connection to {target.authority} within {open_timeout:g}s") from None
    stream = channel.stream_stream(
        grpc_wire.METHOD,
        request_serializer=grpc_wire.serialize,
        response_deserializer=grpc_wire.parse_server_frame,
    )
    return GrpcLink(channel, stream(metadata=metadata), write_timeout=write_timeout)
