"""The agents' WebSocket stream through Channels: authentication, and a thin consumer that
hands frames to :class:`control.agent_sessions.AgentSession`.

Authentication is ASGI middleware on the handshake: ``Authorization: Bearer <node token>``
(and the ``X-Llmgw-Node`` name the agent claims) are checked before the consumer exists, so a
stream without a valid token is refused with HTTP 403 and never reaches any session code. With
``LLMGW_AGENT_REQUIRE_IDENTITY`` a node's identity is its certificate, which this transport
does not carry: every stream is refused at the handshake, before any token is looked up. A
node past its streams per window (:mod:`control.stream_limits`) is closed with 4429 there too.

The channel layer only carries nudges ("node N changed", "token revoked", "a newer stream
took over"); if it goes away the stream stays up, re-reads desired state on its periodic
resync, and rejoins its group when the layer comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import DatabaseError

from agents.protocol.codec import encode
from agents.protocol.messages import ErrorMessage
from agents.protocol.vocabulary import NODE_HEADER, CloseCode
from control import agent_peers, node_tokens, nudges, stream_limits
from control.agent_plumbing import in_credentials_thread
from control.agent_sessions import AgentSession

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SCOPE_KEY = "llmgw_node"
_NODE_HEADER = NODE_HEADER.lower().encode()
# How long a stream that has ended waits for the channel layer's receive to take its
# cancellation; past that the receive is left behind (see _receive_or_leave).
RECEIVE_CANCEL_WAIT_S = 1.0


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown client"


class NodeTokenAuthMiddleware:
    """Admit a WebSocket only with a valid node token; put the node's identity in the scope."""

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if settings.LLMGW_AGENT_REQUIRE_IDENTITY:
            logger.warning(
                "agent stream from %s refused at the handshake: %s", _client(scope), TOKENS_REFUSED
            )
            await _deny(receive, send, scope, CloseCode.FORBIDDEN, TOKENS_REFUSED)
            return
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        claimed_raw = headers.get(_NODE_HEADER)
        claimed = claimed_raw.decode("latin-1").strip() if claimed_raw is not None else None
        try:
            if scheme.lower() != "bearer":
                raise node_tokens.TokenRejected("no bearer token")
            identity = await in_credentials_thread(node_tokens.authenticate)(token.strip(), claimed)
            refusal = await in_credentials_thread(stream_limits.admit)(identity)
        except node_tokens.TokenRejected as exc:
            logger.warning("agent stream from %s refused at the handshake: %s", _client(scope), exc)
            await _deny(receive, send)
            return
        except DatabaseError as exc:
            logger.error("agent stream from %s: store unavailable (%s)", _client(scope), exc)
            await _accept_and_close(
                receive,
                send,
                CloseCode.STORE_UNAVAILABLE,
                "the control plane's store is unavailable; retry later",
            )
            return
        if refusal is not None:
            await _accept_and_close(receive, send, CloseCode.RATE_LIMITED, refusal.message)
            return
        await self.inner({**scope, SCOPE_KEY: identity}, receive, send)


TOKENS_REFUSED = (
    "node tokens are not accepted: LLMGW_AGENT_REQUIRE_IDENTITY makes a node certificate the "
    "only identity; connect over gRPC (--transport grpc) with the node's certificate"
)


async def _deny(
    receive: Receive,
    send: Send,
    scope: Scope | None = None,
    code: CloseCode = CloseCode.UNAUTHORIZED,
    why: str = "",
) -> None:
    """Close before accepting: the server answers the handshake with HTTP 403. ``why`` is the
    answer's body where the server can send one (uvicorn can), for the agent's log; a refused
    credential is never told why."""
    message = await receive()
    if message.get("type") != "websocket.connect":
        return
    if why and scope is not None and "websocket.http.response" in (scope.get("extensions") or {}):
        await send(
            {
                "type": "websocket.http.response.start",
                "status": 403,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": why.encode()})
        return
    await send({"type": "websocket.close", "code": int(code)})


async def _accept_and_close(receive: Receive, send: Send, code: CloseCode, text: str) -> None:
    message = await receive()
    if message.get("type") != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": encode(ErrorMessage(int(code), text))})
    await send({"type": "websocket.close", "code": int(code)})


async def reject_unknown_path(scope: Scope, receive: Receive, send: Send) -> None:
    """Any other WebSocket path: refused at the handshake rather than a server error."""
    await _deny(receive, send)


async def _receive_or_leave(receiving: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """What ``receiving`` (the channel layer's receive) returns. Cancelled (the stream has
    ended), it cancels the receive and waits ``RECEIVE_CANCEL_WAIT_S`` at most for it to end:
    channels_redis's receive has been seen to go on polling Redis after its cancellation, and
    Channels waits for it before the consumer ends, so the stream's task never ended and a web
    process told to stop waited out its whole grace (30 s) whenever it held a stream. A receive
    left behind ends with its next message, or when the process, exiting, cancels it again."""
    task = asyncio.ensure_future(receiving)
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task}, timeout=RECEIVE_CANCEL_WAIT_S)
        if not task.done():
            logger.warning(
                "the channel layer's receive went on after its stream ended; left behind"
            )
        task.add_done_callback(_ignore_outcome)  # nobody waits for what it ends with now
        raise
    return task.result()


def _ignore_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: not reported as never retrieved


class AgentConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]
    """One agent's stream. Everything it decides is in :class:`AgentSession`."""

    session: AgentSession | None = None
    _ticker: asyncio.Task[None] | None = None
    _layer_down = False
    _raw_channel_receive: Callable[[], Awaitable[dict[str, Any]]]

    # Channels assigns ``channel_receive`` and then awaits it for every group message; a
    # channel layer outage would end the consumer (and drop the agent) with an exception.
    # This wrapper waits the outage out instead: the stream lives on, resyncs cover.
    @property
    def channel_receive(self) -> Callable[[], Awaitable[dict[str, Any]]]:
        return self._resilient_channel_receive

    @channel_receive.setter
    def channel_receive(self, value: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._raw_channel_receive = value

    async def _resilient_channel_receive(self) -> dict[str, Any]:
        delay = 0.5
        while True:
            try:
                return await _receive_or_leave(self._raw_channel_receive())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._mark_layer_down(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _mark_layer_down(self, exc: BaseException) -> None:
        if not self._layer_down:
            logger.warning(
                "channel layer unavailable (%s): nudges paused; node %s resyncs from the "
                "database meanwhile",
                type(exc).__name__,
                self.session.name if self.session else "?",
            )
        self._layer_down = True

    async def _join_group(self) -> None:
        assert self.session is not None
        try:
            async with nudges.layer_slot():
                await self.channel_layer.group_add(
                    nudges.node_group(self.session.identity.id), self.channel_name
                )
        except Exception as exc:
            self._mark_layer_down(exc)
            return
        if self._layer_down:
            logger.info("channel layer back: node %s receives nudges again", self.session.name)
        self._layer_down = False

    async def connect(self) -> None:
        identity: node_tokens.NodeIdentity = self.scope[SCOPE_KEY]
        await self.accept()
        self.session = AgentSession(identity, self, peer=agent_peers.websocket_peer(self.scope))
        await self._join_group()
        # An older stream of this node (a half-open one the agent gave up on) closes itself.
        with contextlib.suppress(Exception):
            async with nudges.layer_slot():
                await self.channel_layer.group_send(
                    nudges.node_group(identity.id),
                    {"type": nudges.SESSION_TAKEOVER, "channel": self.channel_name},
                )
        self._ticker = asyncio.create_task(self._tick_loop())

    async def _tick_loop(self) -> None:
        assert self.session is not None
        interval = self.session.tick_interval
        rejoin_every = max(1, int(self.session.resync_interval / interval))
        count = 0
        while not self.session.closed:
            await asyncio.sleep(interval)
            count += 1
            try:
                await self.session.tick()
                # Group membership is lost when the channel layer restarts; joining again is
                # idempotent and cheap.
                if self._layer_down or count % rejoin_every == 0:
                    await self._join_group()
            except Exception:
                logger.exception("node %s: stream housekeeping failed", self.session.name)

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its ``aclose_old_connections()`` before every message:
        that is a hop to the one thread-sensitive sync thread for each frame of each agent, and
        under a storm of reconnecting agents every frame queued on that thread (docs/decisions.md,
        'no per-message hop to the sync thread'). This consumer
        uses the store only through the session's executors, which close or give back their
        connections around each call, so there is nothing of its own to close."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    # Transport for AgentSession --------------------------------------------------------------

    async def send_text(self, text: str) -> None:
        try:
            await self.send(text_data=text)
        except OSError:
            # The agent is gone (uvicorn raises ClientDisconnected, an OSError, where Daphne
            # dropped the frame). Raised out of a handler it would end this consumer before
            # its disconnect() ran, leaving the ticker and the session live for ever; the
            # stream is over instead, and the disconnect event already queued cleans up.
            self._client_gone()

    async def close(self, code: int | bool | None = None, reason: str | None = None) -> None:
        with contextlib.suppress(OSError):  # already gone: nothing left to close
            await super().close(code, reason)

    def _client_gone(self) -> None:
        if self.session is not None:
            self.session.disconnected()

    # Frames and group messages --------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.session is not None:
            await self.session.receive(text_data, bytes_data)

    async def disconnect(self, code: int) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self.session is None:
            return
        self.session.disconnected()
        logger.info("node %s: stream closed (code %s)", self.session.name, code)
        with contextlib.suppress(Exception):
            async with nudges.layer_slot():
                await self.channel_layer.group_discard(
                    nudges.node_group(self.session.identity.id), self.channel_name
                )

    async def desired_changed(self, event: dict[str, Any]) -> None:
        if self.session is not None:
            await self.session.send_desired("nudge")

    async def token_revoked(self, event: dict[str, Any]) -> None:
        if self.session is not None:
            await self.session.fail(CloseCode.UNAUTHORIZED, "this node's token was revoked")

    async def session_takeover(self, event: dict[str, Any]) -> None:
        if self.session is not None and event.get("channel") != self.channel_name:
            await self.session.fail(
                CloseCode.REPLACED, "a newer stream of this node took over; closing this one"
            )
