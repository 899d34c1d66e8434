"""The agents' gRPC stream (``AgentPlane/Stream``, agents/agent.proto): authentication, and a
thin servicer that hands frames to :class:`control.agent_sessions.AgentSession`, the same
session logic the WebSocket consumer drives.

Authentication happens before any session code runs. With ``LLMGW_AGENT_REQUIRE_IDENTITY``
(node certificates on every transport) or ``LLMGW_AGENT_GRPC_REQUIRE_IDENTITY`` (on this
listener alone) the listener admits only clients with a certificate from the cluster CA (the
TLS layer verifies it), and the node is the one the certificate names; no token is taken.
Without either, the listener (TLS when ``init_ca`` made a server certificate) takes the node
token from the call's ``authorization`` metadata, as the WebSocket handshake does. A node past
its streams per window (:mod:`control.stream_limits`) is then ended with 4429, as there.

A close is the end of the call: the session's error message is the last frame, the protocol's
close code is in the trailing metadata, and gRPC's status says the same in gRPC's words.

A listener that is told to stop (SIGTERM from ``manage.py run``) stops taking calls and ends
every open stream with 1012, service restart, as a draining web process does for WebSocket
streams: the agents reconnect to another control plane at once instead of backing off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import grpc
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DatabaseError

from agents import grpc_wire
from agents.protocol.codec import encode
from agents.protocol.messages import ErrorMessage
from agents.protocol.vocabulary import MAX_MESSAGE_BYTES, CloseCode, ProtocolError
from control import agent_peers, node_certs, node_tokens, nudges, stream_limits
from control.agent_plumbing import in_credentials_thread
from control.agent_sessions import AgentSession

logger = logging.getLogger(__name__)

# gRPC's word for each close code, for clients that read only the status.
_STATUS: Final[dict[int, grpc.StatusCode]] = {
    CloseCode.NORMAL: grpc.StatusCode.OK,
    CloseCode.GOING_AWAY: grpc.StatusCode.UNAVAILABLE,
    CloseCode.SERVICE_RESTART: grpc.StatusCode.UNAVAILABLE,
    CloseCode.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    CloseCode.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    CloseCode.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    CloseCode.HELLO_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    CloseCode.REPLACED: grpc.StatusCode.ABORTED,
    CloseCode.TOO_BIG: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CloseCode.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CloseCode.UNSUPPORTED_DATA: grpc.StatusCode.INVALID_ARGUMENT,
    CloseCode.PROTOCOL_VERSION: grpc.StatusCode.FAILED_PRECONDITION,
    CloseCode.STORE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def grpc_status(code: int) -> grpc.StatusCode:
    return _STATUS.get(code, grpc.StatusCode.UNKNOWN)


class _Stream:
    """The session's transport: frames written to the call, a close remembered until the
    servicer ends the call with it."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.context = context
        self._lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.code: int | None = None
        self.reason = ""

    async def send_text(self, text: str) -> None:
        if self.closed.is_set():
            return
        frame = grpc_wire.text_to_frame(text, grpc_wire.ServerFrame)
        async with self._lock:  # one write at a time: the ticker and the reader both send
            await self.context.write(frame)

    async def close(self, code: int, reason: str) -> None:
        if self.code is None:
            self.code, self.reason = code, reason
        self.closed.set()


def _peer(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    return str(context.peer() or "unknown client")


def authenticate(
    metadata: dict[str, str], peer_cert: bytes | None, *, require_identity: bool
) -> node_tokens.NodeIdentity:
    """Who the caller is. Raises :class:`node_tokens.TokenRejected` with a reason for the log."""
    claimed = metadata.get(grpc_wire.NODE_KEY)
    if require_identity:
        if peer_cert is None:
            raise node_tokens.TokenRejected("no client certificate")
        return node_certs.authenticate_certificate(peer_cert, claimed)
    scheme, _, token = metadata.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        raise node_tokens.TokenRejected("no bearer token")
    return node_tokens.authenticate(token.strip(), claimed)


class AgentServicer:
    """``AgentPlane/Stream``, one call per agent stream."""

    def __init__(self, *, require_identity: bool) -> None:
        self.require_identity = require_identity
        self.sessions: set[AgentSession] = set()  # the streams open now, for a stop to end

    async def end_all_streams(self) -> int:
        """Close every open stream with 1012 (this listener is stopping: reconnect elsewhere,
        now); returns how many there were."""
        sessions = list(self.sessions)
        for session in sessions:
            with contextlib.suppress(Exception):  # a stream that broke meanwhile is ended anyway
                await session.fail(
                    CloseCode.SERVICE_RESTART,
                    "this control plane is stopping; reconnect to another one",
                )
        return len(sessions)

    async def stream(self, _requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        metadata = {k: str(v) for k, v in context.invocation_metadata() or ()}
        peer_cert = (context.auth_context().get("x509_pem_cert") or [None])[0]
        try:
            identity = await in_credentials_thread(authenticate)(
                metadata, peer_cert, require_identity=self.require_identity
            )
            refusal = await in_credentials_thread(stream_limits.admit)(identity)
        except node_tokens.TokenRejected as exc:
            logger.warning("agent stream from %s refused: %s", _peer(context), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "node credentials refused")
            return
        except DatabaseError as exc:
            logger.error("agent stream from %s: store unavailable (%s)", _peer(context), exc)
            await self._end(
                context, CloseCode.STORE_UNAVAILABLE, "the control plane's store is unavailable"
            )
            return
        if refusal is not None:
            await self._end(context, CloseCode.RATE_LIMITED, refusal.message)
            return
        transport = _Stream(context)
        session = AgentSession(identity, transport, peer=agent_peers.grpc_peer(context.peer()))
        self.sessions.add(session)
        tasks = {
            asyncio.create_task(self._read(context, session), name="read"),
            asyncio.create_task(_tick(session), name="tick"),
            asyncio.create_task(_nudges(session), name="nudges"),
            asyncio.create_task(transport.closed.wait(), name="closed"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    logger.error(
                        "node %s: the stream's %s failed",
                        identity.name,
                        task.get_name(),
                        exc_info=task.exception(),
                    )
        finally:
            self.sessions.discard(session)
            session.disconnected()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        logger.info("node %s: gRPC stream closed (code %s)", identity.name, transport.code)
        if transport.code is not None and transport.code != CloseCode.NORMAL:
            await self._end(context, CloseCode(transport.code), transport.reason, sent=True)

    async def _read(
        self, context: grpc.aio.ServicerContext[Any, Any], session: AgentSession
    ) -> None:
        while not session.closed:
            data = await context.read()
            if data is grpc.aio.EOF:
                return
            try:
                frame = grpc_wire.parse_agent_frame(bytes(data))
            except ProtocolError as exc:
                await session.fail(exc.code, exc.message)
                return
            await session.receive(grpc_wire.frame_to_text(frame))

    @staticmethod
    async def _end(
        context: grpc.aio.ServicerContext[Any, Any],
        code: CloseCode,
        reason: str,
        *,
        sent: bool = False,
    ) -> None:
        if not sent:
            with contextlib.suppress(Exception):
                await context.write(
                    grpc_wire.text_to_frame(
                        encode(ErrorMessage(int(code), reason)), grpc_wire.ServerFrame
                    )
                )
        context.set_trailing_metadata(((grpc_wire.CLOSE_CODE_KEY, str(int(code))),))
        await context.abort(grpc_status(code), reason)


async def _tick(session: AgentSession) -> None:
    interval = session.tick_interval
    while not session.closed:
        await asyncio.sleep(interval)
        try:
            await session.tick()
        except Exception:
            logger.exception("node %s: stream housekeeping failed", session.name)


async def _nudges(session: AgentSession) -> None:
    """The node's channel-layer group, as the WebSocket consumer joins it: nudges, revocations
    and takeovers. A layer that is down is waited out (resyncs cover meanwhile)."""
    layer = get_channel_layer()
    if layer is None:
        await asyncio.Event().wait()
        return
    group = nudges.node_group(session.identity.id)
    channel = await layer.new_channel()
    delay = 0.5
    joined = False
    try:
        while not session.closed:
            try:
                if not joined:
                    async with nudges.layer_slot():
                        await layer.group_add(group, channel)
                        await layer.group_send(
                            group, {"type": nudges.SESSION_TAKEOVER, "channel": channel}
                        )
                    joined = True
                message = await layer.receive(channel)
                delay = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if joined or delay == 0.5:
                    logger.warning(
                        "channel layer unavailable (%s): node %s resyncs from the database",
                        type(exc).__name__,
                        session.name,
                    )
                joined = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            kind = message.get("type")
            if kind == nudges.DESIRED_CHANGED:
                await session.send_desired("nudge")
            elif kind == nudges.TOKEN_REVOKED:
                await session.fail(CloseCode.UNAUTHORIZED, "this node's credentials were revoked")
            elif kind == nudges.SESSION_TAKEOVER and message.get("channel") != channel:
                await session.fail(
                    CloseCode.REPLACED, "a newer stream of this node took over; closing this one"
                )
    finally:
        with contextlib.suppress(Exception):
            async with nudges.layer_slot():
                await layer.group_discard(group, channel)


# --------------------------------------------------------------------------- the server


def required_identity() -> bool:
    """Whether this listener admits node certificates only (either setting asks it)."""
    return bool(settings.LLMGW_AGENT_REQUIRE_IDENTITY or settings.LLMGW_AGENT_GRPC_REQUIRE_IDENTITY)


def server_credentials(ca_dir: Path, *, require_identity: bool) -> grpc.ServerCredentials | None:
    """TLS from the CA directory (``manage.py init_ca``); None when there is none (plaintext,
    for a loopback listener). Requiring identity without a CA is a configuration error."""
    cert, key, ca = (
        ca_dir / node_certs.SERVER_CERT,
        ca_dir / node_certs.SERVER_KEY,
        ca_dir / node_certs.CA_CERT,
    )
    if not cert.exists():
        if require_identity:
            raise node_certs.CaError(
                f"node certificates are required (LLMGW_AGENT_REQUIRE_IDENTITY or "
                f"LLMGW_AGENT_GRPC_REQUIRE_IDENTITY) but {cert} does not exist; run "
                "`manage.py init_ca` first"
            )
        return None
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=ca.read_bytes() if require_identity else None,
        require_client_auth=require_identity,
    )


# How long the streams a stop ended have to finish their call before it is cancelled.
STOP_GRACE_S: Final = 2.0

SERVER_OPTIONS: Final = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Agents ping every few seconds to find half-open connections; allow it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


def build_server(
    listen: str, *, ca_dir: Path, require_identity: bool
) -> tuple[grpc.aio.Server, AgentServicer, int, bool]:
    """The server with the servicer and its port bound (not started):
    (server, servicer, port, tls)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = AgentServicer(require_identity=require_identity)
    handler = grpc.method_handlers_generic_handler(
        grpc_wire.SERVICE,
        {
            # Requests stay bytes until the servicer parses them, so a frame that is not one
            # closes the stream with the protocol's code instead of failing inside grpc.
            "Stream": grpc.stream_stream_rpc_method_handler(
                servicer.stream, response_serializer=grpc_wire.serialize
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    credentials = server_credentials(ca_dir, require_identity=require_identity)
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    return server, servicer, port, credentials is not None


async def serve(
    listen: str,
    *,
    ca_dir: Path | None = None,
    require_identity: bool | None = None,
    stop: asyncio.Event | None = None,
    started: Callable[[int], Awaitable[None] | None] | None = None,
) -> None:
    """Serve agent streams on ``listen`` (``host:port``) until ``stop`` is set (or SIGTERM /
    SIGINT when none is given); streams in flight get a short grace to close."""
    ca = Path(ca_dir or settings.LLMGW_CA_DIR)
    require = required_identity() if require_identity is None else require_identity
    server, servicer, port, tls = build_server(listen, ca_dir=ca, require_identity=require)
    await server.start()
    logger.info(
        "agent gRPC listener on %s (port %s, %s)",
        listen,
        port,
        "mutual TLS: node certificates only"
        if require
        else ("TLS, node tokens" if tls else "plaintext, node tokens"),
    )
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    if started is not None:
        result = started(port)
        if result is not None:
            await result
    await stop.wait()
    # New calls are refused from here on (an agent must not come back to this listener);
    # the open streams are then told to go elsewhere, and get a short grace to end.
    stopping = asyncio.create_task(server.stop(grace=STOP_GRACE_S))
    await asyncio.sleep(0)
    ended = await servicer.end_all_streams()
    logger.info("agent gRPC listener stopping: %d stream(s) told to reconnect elsewhere", ended)
    await stopping
