"""What every agent stream of a web process shares, apart from the session protocol
(:mod:`control.agent_sessions`): the threads their store work runs on, the reads and writes
they make together, and the clocks that limit them.

Store work runs on threads of its own kinds (:func:`in_store_thread`,
:func:`in_heartbeat_thread`, :func:`in_credentials_thread`), so a queue of one kind never holds
up another. The periodic reads of every stream's node row share one query
(:class:`NodeRowReader`), and their heartbeats one write (:class:`HeartbeatWriter`).
:class:`TokenBucket` holds a stream to a message rate; :class:`Coalescer` says when a write is
due at most once per interval.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from channels.db import database_sync_to_async
from django.db import DatabaseError, connections

from control import agent_reports, health
from control.models import Node

logger = logging.getLogger(__name__)
_R = TypeVar("_R")


def store_threads() -> int:
    """Threads that run the streams' store work. One by default, as Channels does it: every
    stream of the process waits on one thread. With a PostgreSQL pool, all the pool's
    connections but the two that the heartbeat writer and the credential checks keep: a
    thousand agents reconnecting at once queue behind one thread for tens of seconds, and the
    store has cores of its own; and a handshake must not wait for a connection behind them
    (docs/decisions.md, 'threads for the streams' store work'). SQLite keeps one writer
    anyway."""
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
    behind a queue of hellos and desired states, or live nodes flap to unreachable
    (docs/decisions.md, 'threads for the streams' store work')."""
    wrapped: Callable[..., Awaitable[_R]] = database_sync_to_async(
        func, thread_sensitive=False, executor=_executor("heartbeats", 1)
    )
    return wrapped


def in_credentials_thread(func: Callable[..., _R]) -> Callable[..., Awaitable[_R]]:
    """``func`` made awaitable on a thread of its own for credential checks (a handshake's
    token and its count of the node's streams, a stream's periodic "still valid?"): one
    indexed read or one-row upsert each, which must not queue behind the hellos and desired
    states of other streams: queued there in a reconnect storm, handshakes pass the agents'
    opening timeout and each retry adds more work (docs/decisions.md, 'threads for the
    streams' store work'). The thread waits for a pool connection like any other; it holds one
    only for one statement."""
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
    one by one that was two queries per stream per interval queued on the store threads, the
    largest part of their work in a reconnect storm (docs/decisions.md, 'resyncs read
    together')."""

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
