"""One agent's stream, on the control-plane side, whatever carries it.

:class:`AgentSession` holds the protocol logic: hello first (within a deadline), then status
and heartbeats in, full desired state out (on connect, on a nudge, when the periodic resync
finds the revision moved, and every few resyncs regardless). A transport — the Channels
consumer in :mod:`control.consumers`, the gRPC servicer in :mod:`control.agent_grpc` — only
moves text frames and calls :meth:`AgentSession.receive`, :meth:`AgentSession.tick`,
:meth:`AgentSession.send_desired`; authentication happened before the session exists.

Every stream is held to a message rate (closed with 4429 past it), and re-checks the credential
it was opened with at each resync, so a revocation ends it on every process.

Writes are kept small: a shard's row is written when its reported state changes, load and
GPU memory and the heartbeat at most every :func:`control.health.heartbeat_write_interval`,
and the heartbeats of all the process's streams together (:class:`HeartbeatWriter`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol, TypeVar

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError, connections

from agents.protocol.codec import decode_agent_message, encode
from agents.protocol.messages import ErrorMessage, Heartbeat, Hello, ShardStatus, Status, Welcome
from agents.protocol.vocabulary import CloseCode, ProtocolError
from control import agent_reports, desired_state, health, node_tokens
from control.models import Node

logger = logging.getLogger(__name__)
_R = TypeVar("_R")

HELLO_TIMEOUT: Final = 10.0
# The periodic resync sends the full desired state only every this many times; in between it
# reads the node's revision (one row) and sends only if it moved: a lost nudge is still found
# within one resync interval, and a thousand streams do not re-read every shard of their node
# every interval.
FULL_RESYNC_EVERY: Final = 4


def store_threads() -> int:
    """Threads that run the streams' store work. One by default, as Channels does it: every
    stream of the process waits on one thread. With a PostgreSQL pool, all the pool's
    connections but the two that the heartbeat writer and the credential checks keep: a
    thousand agents reconnecting at once queue behind one thread for tens of seconds, and the
    store has cores of its own; and a handshake must not wait for a connection behind them
    (measured at 1,000 nodes: with every connection busy, five handshakes waited past the
    pool's timeout and were answered "store unavailable"). SQLite keeps one writer anyway."""
    pool = connections["default"].settings_dict.get("OPTIONS", {}).get("pool")
    if isinstance(pool, dict):
        return max(1, int(pool.get("max_size", 3)) - 2)
    return 1


_executors: dict[str, ThreadPoolExecutor] = {}


def _executor(name: str, threads: int) -> ThreadPoolExecutor:
    if name not in _executors:
        _executors[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"llmgw-{name}")
    return _executors[name]


def in_store_thread(func: Callable[..., _R]) -> Callable[..., Awaitable[_R]]:
    """``func`` made awaitable on the streams' store threads (connections closed or given back
    to the pool around each call, as Channels' ``database_sync_to_async`` does)."""
    wrapped: Callable[..., Awaitable[_R]] = database_sync_to_async(
        func, thread_sensitive=False, executor=_executor("store", store_threads())
    )
    return wrapped


def in_heartbeat_thread(func: Callable[..., _R]) -> Callable[..., Awaitable[_R]]:
    """``func`` made awaitable on a thread of its own: the heartbeat write must never wait
    behind a queue of hellos and desired states (measured at 1,000 nodes: it waited more
    than the unreachable threshold, and live nodes flapped to unreachable)."""
    wrapped: Callable[..., Awaitable[_R]] = database_sync_to_async(
        func, thread_sensitive=False, executor=_executor("heartbeats", 1)
    )
    return wrapped


def in_credentials_thread(func: Callable[..., _R]) -> Callable[..., Awaitable[_R]]:
    """``func`` made awaitable on a thread of its own for credential checks (a handshake's
    token, a stream's periodic "still valid?"): one indexed read each, which must not queue
    behind the hellos and desired states of other streams. Measured at 1,000 nodes: after a
    control plane was killed, 500 handshakes queued behind 1,500 pieces of session work on the
    store threads, hundreds passed the agents' 10 s opening timeout, and each retry added more
    work (the fleet took 42 to 60 s to be back). The thread waits for a pool connection like
    any other; it holds one only for a read."""
    wrapped: Callable[..., Awaitable[_R]] = database_sync_to_async(
        func, thread_sensitive=False, executor=_executor("credentials", 1)
    )
    return wrapped


@dataclass(frozen=True)
class NodeRow:
    """What a stream's periodic resync needs of its node's row."""

    token_hash: str
    cert_serial: str
    desired_revision: int


def read_node_rows(node_ids: Collection[int]) -> dict[int, NodeRow]:
    """The rows of many nodes in one read (a node that is gone has none)."""
    rows = Node.objects.filter(pk__in=list(node_ids)).values_list(
        "pk", "token_hash", "cert_serial", "desired_revision"
    )
    return {pk: NodeRow(token_hash, serial, revision) for pk, token_hash, serial, revision in rows}


class NodeRowReader:
    """The periodic resyncs of every stream of this process, read together: a stream asks for
    its node's row, and the requests made within :attr:`window` seconds share one query.

    Each stream re-checks its credential and its node's revision every resync interval; read
    one by one that was, at 1,000 nodes, two queries per stream per interval queued on the
    store threads (the largest part of their work while 500 agents reconnected)."""

    window = 0.05

    def __init__(self) -> None:
        self.waiting: dict[int, list[asyncio.Future[NodeRow | None]]] = {}
        self.flushing: asyncio.Task[None] | None = None

    async def read(self, node_id: int) -> NodeRow | None:
        """The node's row (None: the node is gone); raises DatabaseError as the read would."""
        future: asyncio.Future[NodeRow | None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(node_id, []).append(future)
        if self.flushing is None:
            self.flushing = asyncio.create_task(self._flush_soon())
        return await future

    async def _flush_soon(self) -> None:
        await asyncio.sleep(self.window)
        waiting, self.waiting, self.flushing = self.waiting, {}, None
        try:
            rows = await in_credentials_thread(read_node_rows)(list(waiting))
        except Exception as exc:  # every reader gets the read's failure, as its own read would
            for futures in waiting.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        for node_id, futures in waiting.items():
            for future in futures:
                if not future.done():  # (a stream closed meanwhile cancelled its wait)
                    future.set_result(rows.get(node_id))


_readers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, NodeRowReader] = (
    weakref.WeakKeyDictionary()
)


def node_row_reader() -> NodeRowReader:
    """This event loop's reader (a web process has one loop; tests make several)."""
    loop = asyncio.get_running_loop()
    reader = _readers.get(loop)
    if reader is None:
        reader = _readers[loop] = NodeRowReader()
    return reader


class Transport(Protocol):
    async def send_text(self, text: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class TokenBucket:
    """At most ``rate`` per second on average, ``burst`` at once (monotonic clock)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.clock = clock
        self.tokens = float(burst)
        self.last = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Coalescer:
    """Says "write now" at most once per interval (monotonic clock)."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self.interval = interval
        self.clock = clock
        self.last = -math.inf

    def due(self) -> bool:
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            return True
        return False


class HeartbeatWriter:
    """The heartbeats of every stream of this process, written together.

    Streams mark their node alive (each at most every write interval, see
    :class:`Coalescer`); a task on the event loop writes every marked node in one statement
    each :func:`control.health.heartbeat_flush_interval`. A thousand streams cost one commit
    per flush instead of hundreds a second. A failed write keeps the marks for the next one.
    """

    def __init__(self, interval: float | None = None) -> None:
        self.interval = interval
        self.pending: set[int] = set()
        self.writes = 0
        self._task: asyncio.Task[None] | None = None

    def mark(self, node_id: int) -> None:
        self.pending.add(node_id)
        task = self._task
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._run(), name="heartbeat-writer")

    async def flush(self) -> int:
        """Write what is marked now; how many nodes."""
        ids, self.pending = self.pending, set()
        if not ids:
            return 0
        try:
            await in_heartbeat_thread(agent_reports.record_heartbeats)(ids)
        except BaseException:
            self.pending |= ids
            raise
        self.writes += 1
        return len(ids)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval or health.heartbeat_flush_interval())
            try:
                await self.flush()
            except DatabaseError as exc:
                logger.warning("heartbeats of %d node(s) not written: %s", len(self.pending), exc)


_process_heartbeats: HeartbeatWriter | None = None


def process_heartbeats() -> HeartbeatWriter:
    """The one writer of this process's streams."""
    global _process_heartbeats
    if _process_heartbeats is None:
        _process_heartbeats = HeartbeatWriter()
    return _process_heartbeats


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
    ) -> None:
        self.identity = identity
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
        try:
            await in_store_thread(agent_reports.register_hello)(self.identity.id, hello)
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
