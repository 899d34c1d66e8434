"""One agent's stream, on the control-plane side, whatever carries it.

:class:`AgentSession` holds the protocol logic: hello first (within a deadline), then status
and heartbeats in, full desired state out (on connect, on a nudge, when the periodic resync
finds the revision moved, and every few resyncs regardless). A transport — the Channels
consumer in :mod:`control.consumers`, the gRPC servicer in :mod:`control.agent_grpc` — only
moves text frames and calls :meth:`AgentSession.receive`, :meth:`AgentSession.tick`,
:meth:`AgentSession.send_desired`; authentication happened before the session exists.

Every stream is held to a message rate (closed with 4429 past it), and re-checks the credential
it was opened with at each resync, so a revocation ends it on every process. A fresh stream is
a fresh allowance, so the streams a node opens are themselves counted, across processes, at
the handshake before a session exists (:mod:`control.stream_limits`).

Writes are kept small: a shard's row is written when its reported state changes, load and
GPU memory and the heartbeat at most every :func:`control.health.heartbeat_write_interval`,
and the heartbeats of all the process's streams together. The threads, the shared reads and
writes and the rate limits the streams of a process have in common are in
:mod:`control.agent_plumbing`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

from django.conf import settings
from django.db import DatabaseError

from agents.protocol.codec import decode_agent_message, encode
from agents.protocol.messages import ErrorMessage, Heartbeat, Hello, ShardStatus, Status, Welcome
from agents.protocol.vocabulary import CloseCode, ProtocolError
from control import agent_peers, agent_reports, desired_state, health, node_tokens
from control.agent_plumbing import (
    Coalescer,
    HeartbeatWriter,
    NodeRow,
    TokenBucket,
    in_store_thread,
    node_row_reader,
    process_heartbeats,
)
from control.models import Node

logger = logging.getLogger(__name__)

HELLO_TIMEOUT: Final = 10.0
# The periodic resync sends the full desired state only every this many times; in between it
# reads the node's revision (one row) and sends only if it moved: a lost nudge is still found
# within one resync interval, and a thousand streams do not re-read every shard of their node
# every interval.
FULL_RESYNC_EVERY: Final = 4


class Transport(Protocol):
    async def send_text(self, text: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


def _state_key(report: ShardStatus) -> tuple[Any, ...]:
    """What makes a shard report worth a write at once (load changes wait for the beat)."""
    return (
        report.generation,
        report.state,
        report.exit_code,
        report.failure_class,
        report.message,
    )


@dataclass
class _Written:
    """What this session last wrote, so an unchanged report costs no write."""

    shards: dict[int, ShardStatus]
    revision: int | None = None
    stale_rejected: int | None = None
    weights: tuple[Any, ...] | None = None
    gpus: tuple[Any, ...] | None = None


class AgentSession:
    """The control plane's half of one agent stream."""

    def __init__(
        self,
        identity: node_tokens.NodeIdentity,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        heartbeats: HeartbeatWriter | None = None,
        peer: str = "",
    ) -> None:
        self.identity = identity
        self.peer = peer  # the address the stream comes from (control.agent_peers)
        self.heartbeats = heartbeats or process_heartbeats()
        self.transport = transport
        self.clock = clock
        self.opened_at = clock()
        self.hello: Hello | None = None
        self.closed = False
        self.heartbeat_interval = float(settings.LLMGW_AGENT_HEARTBEAT_INTERVAL)
        self.resync_interval = float(settings.LLMGW_AGENT_RESYNC_INTERVAL)
        self.next_resync = math.inf
        self.resyncs = 0
        self.revision_poll = float(settings.LLMGW_AGENT_REVISION_POLL)
        self.next_revision_poll = 0.0
        self.beats = Coalescer(health.heartbeat_write_interval(), clock)
        self.written = _Written(shards={})
        self.sent_revision: int | None = None
        self.awaiting_epoch = False
        self._send_lock = asyncio.Lock()
        # An agent sends a few messages a second at most (status on change, a heartbeat per
        # interval); one that sends far more is broken or hostile, and each costs the store.
        self.inbound = TokenBucket(
            float(settings.LLMGW_AGENT_MESSAGES_PER_SECOND),
            int(settings.LLMGW_AGENT_MESSAGE_BURST),
            clock,
        )

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def tick_interval(self) -> float:
        return min(1.0, self.revision_poll) if self.revision_poll else 1.0

    # ----------------------------------------------------------------------- inbound

    async def receive(self, text: str | None = None, data: bytes | None = None) -> None:
        """One frame from the agent. Bad input closes this stream with a clear code and
        message; it never raises, so the server keeps serving every other agent."""
        if self.closed:
            return
        try:
            if not self.inbound.take():
                raise ProtocolError(
                    CloseCode.RATE_LIMITED,
                    f"more than {self.inbound.rate:g} messages a second "
                    f"(burst {self.inbound.burst:g}); reconnect and send less",
                )
            message = decode_agent_message(text if data is None else data)
            if self.hello is None:
                if not isinstance(message, Hello):
                    raise ProtocolError(
                        CloseCode.MALFORMED, f"expected hello first, got {type(message).__name__}"
                    )
                await self._on_hello(message)
            elif isinstance(message, Hello):
                raise ProtocolError(CloseCode.MALFORMED, "hello sent twice on one stream")
            elif isinstance(message, Status):
                await self._on_status(message)
            elif isinstance(message, Heartbeat):
                await self._on_heartbeat()
            else:
                logger.warning(
                    "node %s reports an error %s: %s", self.name, message.code, message.message
                )
        except ProtocolError as exc:
            logger.warning("node %s: %s (closing with %s)", self.name, exc.message, int(exc.code))
            await self.fail(exc.code, exc.message)
        except DatabaseError as exc:
            # The store is down: this stream cannot do its job; the agent retries later and
            # keeps its shards running meanwhile.
            logger.error("node %s: store unavailable (%s); closing the stream", self.name, exc)
            await self.fail(CloseCode.STORE_UNAVAILABLE, "the control plane's store is unavailable")

    async def _on_hello(self, hello: Hello) -> None:
        if hello.node != self.identity.name:
            raise ProtocolError(
                CloseCode.FORBIDDEN,
                f"this stream is authenticated as node {self.identity.name!r}, not {hello.node!r}",
            )
        refusal = agent_peers.loopback_refusal(hello.addresses, self.peer)
        if refusal is not None:
            raise ProtocolError(CloseCode.FORBIDDEN, refusal)
        try:
            await in_store_thread(agent_reports.register_hello)(
                self.identity.id, hello, over_loopback=agent_peers.over_loopback(self.peer)
            )
        except Node.DoesNotExist:
            # Deleted between the handshake and hello: its token went with it.
            raise ProtocolError(CloseCode.UNAUTHORIZED, "this node no longer exists") from None
        self.hello = hello
        self.beats.due()  # register_hello wrote the heartbeat
        await self.transport.send_text(
            encode(
                Welcome(
                    node=self.name,
                    heartbeat_interval=self.heartbeat_interval,
                    server_version=str(settings.LLMGW_VERSION),
                )
            )
        )
        await self.send_desired("connect")

    async def _on_heartbeat(self) -> None:
        if self.beats.due():
            self.heartbeats.mark(self.identity.id)

    async def _on_status(self, status: Status) -> None:
        beat = self.beats.due()
        written = self.written
        changed = [
            report
            for report in status.shards
            if (old := written.shards.get(report.shard_id)) is None
            or _state_key(old) != _state_key(report)
            or (beat and old != replace(report, log_tail=old.log_tail))
        ]
        report = agent_reports.NodeReport(
            observed_revision=_if_changed(status.observed_revision, written.revision),
            stale_rejected=_if_changed(status.stale_rejected, written.stale_rejected),
            weights=_if_changed(status.weights, written.weights),
            gpus=status.gpus if beat and status.gpus != written.gpus else None,
        )
        if changed or report != agent_reports.NodeReport():
            await in_store_thread(agent_reports.record_status)(self.identity.id, changed, report)
        if beat:
            self.heartbeats.mark(self.identity.id)
        # Remembered only once written: a failed write is retried with the next status, and a
        # load change that arrived between beats is written at the next one, not forgotten
        # (a stale "requests running" would keep its replica from ever being idle).
        kept = {r.shard_id: r for r in changed}
        written.shards = {
            r.shard_id: kept.get(r.shard_id, written.shards.get(r.shard_id, r))
            for r in status.shards
        }
        written.revision = status.observed_revision
        written.stale_rejected = status.stale_rejected
        written.weights = status.weights
        if report.gpus is not None:
            written.gpus = status.gpus

    # ----------------------------------------------------------------------- outbound

    async def send_desired(self, reason: str) -> None:
        """Send the node's full desired state, read afresh from the database."""
        if self.closed or self.hello is None:
            return
        async with self._send_lock:
            try:
                desired = await in_store_thread(desired_state.build_desired_state)(self.identity.id)
            except DatabaseError as exc:
                # Keep the stream: the agent keeps what it runs; the next resync tries again.
                logger.warning(
                    "node %s: cannot read desired state (%s); will retry", self.name, exc
                )
                self.next_resync = self.clock() + min(self.resync_interval, 2.0)
                return
            if desired.epoch < self.hello.highest_epoch:
                # The agent would refuse it (a restored or reset store). The leader moves its
                # epoch above the agent's at its next tick; look again shortly, send nothing
                # meanwhile: the agent keeps what it runs.
                if not self.awaiting_epoch:
                    logger.warning(
                        "node %s: has seen epoch %s, the lease is at %s; waiting for the "
                        "leader to move above it",
                        self.name,
                        self.hello.highest_epoch,
                        desired.epoch,
                    )
                self.awaiting_epoch = True
                self.next_resync = self.clock() + self.tick_interval
                return
            self.awaiting_epoch = False
            await self.transport.send_text(encode(desired))
            self.next_resync = self.clock() + self.resync_interval
            if desired.revision != self.sent_revision:
                logger.info(
                    "node %s: sent desired state revision %s epoch %s (%d shards) on %s",
                    self.name,
                    desired.revision,
                    desired.epoch,
                    len(desired.shards),
                    reason,
                )
            self.sent_revision = desired.revision

    async def tick(self) -> None:
        """Call often (every :attr:`tick_interval`): the hello deadline, the periodic
        resync, and the revision poll."""
        if self.closed:
            return
        now = self.clock()
        if self.hello is None:
            if now - self.opened_at >= HELLO_TIMEOUT:
                await self.fail(CloseCode.HELLO_TIMEOUT, f"no hello within {HELLO_TIMEOUT:g}s")
            return
        if now >= self.next_resync:
            try:
                row = await node_row_reader().read(self.identity.id)
            except DatabaseError:
                # The store cannot tell now: the stream goes on (the agent keeps what it runs,
                # the outage is handled elsewhere) and looks again at the next resync.
                self.next_resync = now + self.resync_interval
                return
            # The credential is checked against the store here, so a revoked token or
            # certificate ends the stream within one resync interval on every process, even
            # where no channel layer carried the revocation's nudge.
            if row is None or not node_tokens.holds_credential(
                self.identity, row.token_hash, row.cert_serial
            ):
                await self.fail(
                    CloseCode.UNAUTHORIZED, "this node's credentials were revoked or replaced"
                )
                return
            self.resyncs += 1
            if self.resyncs % FULL_RESYNC_EVERY == 0:
                await self.send_desired("resync")
            else:
                self.next_resync = now + self.resync_interval
                await self._send_if_revised(row)
        elif self.revision_poll and now >= self.next_revision_poll:
            self.next_revision_poll = now + self.revision_poll
            try:
                row = await node_row_reader().read(self.identity.id)
            except DatabaseError:
                return  # the next poll or resync looks again
            await self._send_if_revised(row)

    async def _send_if_revised(self, row: NodeRow | None) -> None:
        """The nudge's stand-in where the channel layer cannot carry one across processes."""
        if row is not None and row.desired_revision != self.sent_revision:
            await self.send_desired("revision change")

    async def fail(self, code: CloseCode, message: str) -> None:
        """Tell the agent why, then close with ``code``."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.transport.send_text(encode(ErrorMessage(int(code), message)))
        finally:
            # A close reason is limited to 123 bytes by RFC 6455.
            await self.transport.close(int(code), message.encode()[:120].decode(errors="ignore"))

    def disconnected(self) -> None:
        self.closed = True


def _if_changed(value: Any, previous: Any) -> Any:
    return value if value != previous else None
