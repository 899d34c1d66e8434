"""Usage rows: one per request, written off the request path, exactly once, never lost.

The request path only appends: a line to this process's journal (a plain ``write(2)``, so
the line is in the kernel and survives ``kill -9`` of the process) and a record to an
in-memory queue. A background task writes the queue to the store in batches with
``bulk_create(ignore_conflicts=True)`` on the unique request id, and fsyncs the journal first.
So a row replayed twice is still one row.

A request that reaches an engine writes a *start* line first. If the process dies before the
request's *done* line, the sweeper (any web process, at start and every half minute) finds
the dead process's journal — it is no longer locked — writes its rows that are missing, closes
the requests still in flight as ``interrupted``, and deletes the journal. ``SIGTERM`` and a
normal exit flush the queue at exit and close what is still in flight the same way.

Each journal is a segment: once everything in it is in the store, a new segment is started
(carrying over the requests still in flight) and the old one deleted, so journals stay small.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import (
    DatabaseError,
    IntegrityError,
    connection,
    transaction,
)
from django.utils import timezone

from gateway import dbthread
from gateway.models import ApiKey, UsageRecord

logger = logging.getLogger(__name__)

# Rotate the journal once it is this big (and everything in it is stored) ...
SEGMENT_BYTES = 4 * 1024 * 1024
# ... or this old.
SEGMENT_SECONDS = 60.0
SWEEP_EVERY_S = 30.0
BATCH = 1000


@dataclass
class Usage:
    """One request's usage row, as plain data (what the journal holds)."""

    request_id: str
    api_key_id: int | None
    user_id: int | None
    model: str
    endpoint: str
    started_at: float  # Unix time
    upstream: str = ""
    status: int = 0
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    finish_reason: str = ""

    def values(self, created_at: Any) -> tuple[Any, ...]:
        """The row for ``INSERT_SQL``, in ``COLUMNS`` order, adapted for this connection;
        ``created_at`` comes adapted already (one value serves a whole batch: adapting it per
        row was half of this function's 8 us on SQLite, measured)."""
        adapt = connection.ops.adapt_datetimefield_value
        return (
            self.request_id,
            self.api_key_id,
            self.user_id,
            # The client's own string: PostgreSQL text cannot hold NUL, and one such row
            # would hold back every row of its batch.
            self.model[:200].replace("\x00", "\ufffd"),
            self.endpoint,
            self.upstream[:300],
            self.status,
            self.stream,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            self.ttft_ms,
            self.duration_ms,
            self.finish_reason,
            adapt(datetime.fromtimestamp(self.started_at, tz=UTC)),
            created_at,
        )


COLUMNS = (
    "request_id",
    "api_key_id",
    "user_id",
    "model",
    "endpoint",
    "upstream",
    "status",
    "stream",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "duration_ms",
    "finish_reason",
    "started_at",
    "created_at",
)
# Raw SQL, not bulk_create(): building model instances cost 80-160 us per row when measured,
# CPU the web process spends on every request. ON CONFLICT DO NOTHING (SQLite and
# PostgreSQL alike) is what makes a replayed row count once.
# The table and column names are constants; every value is a parameter.
INSERT_SQL = (
    f"INSERT INTO {UsageRecord._meta.db_table} ({', '.join(COLUMNS)}) "  # noqa: S608
    f"VALUES ({', '.join(['%s'] * len(COLUMNS))}) ON CONFLICT (request_id) DO NOTHING"
)
_MODEL_COLUMNS = {f.column for f in UsageRecord._meta.concrete_fields if not f.primary_key}
assert set(COLUMNS) == _MODEL_COLUMNS, "UsageRecord changed: update gateway.usage.COLUMNS"


def _line(kind: str, usage: Usage) -> bytes:
    # vars(), not dataclasses.asdict(): the fields are flat, and asdict's recursive deep copy
    # cost ~170 us per call. orjson: 1.7 us a line against 7.4 us for json.dumps (measured),
    # which with the 0.5 us write(2) is cheap enough to journal both lines on the request path.
    entry = {"t": kind, **vars(usage)}
    try:
        return orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        # A string orjson will not encode (a lone surrogate in a model name a client sent).
        return json.dumps(entry, separators=(",", ":")).encode() + b"\n"


def store_rows(records: Iterable[Usage]) -> int:
    """Write rows that are not there yet (runs in the database thread). Returns how many."""
    dbthread.ready()
    records = list(records)
    if not records:
        return 0
    created_at = connection.ops.adapt_datetimefield_value(timezone.now())
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.executemany(INSERT_SQL, [r.values(created_at) for r in records])
    except IntegrityError:
        # A key or user deleted while its requests were queued: keep the rows, as the
        # foreign keys' SET_NULL would have, instead of failing the batch forever.
        records = _without_deleted_owners(records)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.executemany(INSERT_SQL, [r.values(created_at) for r in records])
    keys = {r.api_key_id for r in records if r.api_key_id is not None}
    if keys:
        # Coalesced here rather than written by each request.
        last = datetime.fromtimestamp(max(r.started_at for r in records), tz=UTC)
        ApiKey.objects.filter(pk__in=keys).update(last_used_at=last)
    return len(records)


def _without_deleted_owners(records: list[Usage]) -> list[Usage]:
    key_ids = {r.api_key_id for r in records if r.api_key_id is not None}
    user_ids = {r.user_id for r in records if r.user_id is not None}
    live_keys = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True))
    live_users = set(get_user_model().objects.filter(pk__in=user_ids).values_list("pk", flat=True))
    kept = []
    for record in records:
        copy = Usage(**vars(record))
        if copy.api_key_id not in live_keys:
            copy.api_key_id = None
        if copy.user_id not in live_users:
            copy.user_id = None
        kept.append(copy)
    return kept


def interrupted(start: Usage, now: float) -> Usage:
    """The row for a request whose process stopped before it ended."""
    closed = Usage(**vars(start))
    closed.finish_reason = UsageRecord.FinishReason.INTERRUPTED
    closed.duration_ms = max(0.0, (now - start.started_at) * 1000)
    return closed


def read_journal(path: Path) -> list[Usage]:
    """The rows a journal stands for: done records, and interrupted rows for open starts."""
    done: dict[str, Usage] = {}
    started: dict[str, Usage] = {}
    with path.open("rb") as handle:
        for raw in handle:
            try:
                entry = json.loads(raw)
                kind = entry.pop("t")
                usage = Usage(**entry)
            except (ValueError, TypeError, KeyError):
                continue  # a line cut short by a crash: its request has another line or none
            (done if kind == "d" else started)[usage.request_id] = usage
    now = time.time()
    rows = list(done.values())
    rows += [interrupted(s, now) for rid, s in started.items() if rid not in done]
    return rows


def sweep(directory: Path) -> int:
    """Replay and delete the journals of processes that are gone. Returns rows replayed."""
    replayed = 0
    if not directory.is_dir():
        return 0
    for path in sorted(directory.glob("*.journal")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue  # another sweeper took it
        try:
            try:
                # The owner holds this lock for its whole life: getting it means the owner died.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if not path.exists():
                continue
            rows = read_journal(path)
            store_rows(rows)
            replayed += len(rows)
            path.unlink()
            logger.info("replayed %d usage rows from %s", len(rows), path.name)
        finally:
            os.close(fd)
    return replayed


class Recorder:
    """This process's usage pipeline: journal, queue, batch writer, sweeper."""

    def __init__(self) -> None:
        self.queue: list[Usage] = []
        self.in_flight: dict[str, Usage] = {}
        self._fd = -1
        self._path: Path | None = None
        self._segment_started = 0.0
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._pid = -1
        self._exit_hook = False

    # --- the request path: appends only -------------------------------------------------

    def start(self, usage: Usage) -> None:
        """The request is about to reach an engine: from now on it must end up as a row."""
        self._ensure_journal()
        self.in_flight[usage.request_id] = usage
        os.write(self._fd, _line("s", usage))

    def finish(self, usage: Usage) -> None:
        self._ensure_journal()
        self.in_flight.pop(usage.request_id, None)
        os.write(self._fd, _line("d", usage))
        self.queue.append(usage)
        if len(self.queue) >= BATCH and self._wake is not None:
            self._wake.set()

    # --- background ------------------------------------------------------------------------

    def ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="llmgw-usage-writer")
        if not self._exit_hook:
            atexit.register(self.close)
            self._exit_hook = True

    async def _run(self) -> None:
        assert self._wake is not None
        next_sweep = 0.0
        failures = 0
        while True:
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_EVERY_S
                try:
                    await sync_to_async(sweep)(self.directory())
                except Exception:
                    logger.exception("usage journal sweep failed")
            try:
                await self.flush()
                failures = 0
            except DatabaseError as exc:
                # Rows stay queued and journaled; try again, backing off while the store is down.
                failures += 1
                logger.warning("usage rows not written yet (%d queued): %s", len(self.queue), exc)
            except Exception:
                failures += 1
                logger.exception("usage writer failed")
            delay = float(settings.LLMGW_USAGE_FLUSH_INTERVAL) * min(2**failures, 20)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()

    async def flush(self) -> int:
        if not self.queue:
            return 0
        batch = self.queue[:]
        fd = self._fd
        await sync_to_async(self._durable_store)(fd, batch)
        # Only what was stored leaves the queue; records added meanwhile stay.
        del self.queue[: len(batch)]
        self._maybe_rotate()
        return len(batch)

    @staticmethod
    def _durable_store(fd: int, batch: list[Usage]) -> None:
        if fd >= 0:
            os.fsync(fd)  # the journal first: once it is durable, losing the store loses nothing
        store_rows(batch)

    # --- the journal -------------------------------------------------------------------------

    def directory(self) -> Path:
        return Path(settings.LLMGW_USAGE_JOURNAL_DIR)

    def _ensure_journal(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            return
        self._open_segment()

    def _open_segment(self) -> None:
        directory = self.directory()
        directory.mkdir(parents=True, exist_ok=True)
        self._pid = os.getpid()
        path = directory / f"{self._pid}-{secrets.token_hex(4)}.journal"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Requests in flight are carried over, so the old segment can go once it is stored.
        for usage in self.in_flight.values():
            os.write(fd, _line("s", usage))
        for usage in self.queue:
            os.write(fd, _line("d", usage))
        old_fd, old_path = self._fd, self._path
        self._fd, self._path, self._segment_started = fd, path, time.monotonic()
        if old_fd >= 0 and old_path is not None:
            os.fsync(fd)
            old_path.unlink(missing_ok=True)
            os.close(old_fd)

    def _maybe_rotate(self) -> None:
        if self._fd < 0 or self._path is None:
            return
        age = time.monotonic() - self._segment_started
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            size = SEGMENT_BYTES
        if size >= SEGMENT_BYTES or (age >= SEGMENT_SECONDS and size > 0):
            self._open_segment()

    def close(self) -> None:
        """At exit (SIGTERM included): store everything, close what is in flight as
        interrupted, and delete the journal. If the store is down the journal stays behind
        for the sweeper."""
        if self._fd < 0 or self._pid != os.getpid():
            return
        now = time.time()
        for usage in list(self.in_flight.values()):
            self.finish(interrupted(usage, now))
        try:
            self._durable_store(self._fd, self.queue)
        except Exception as exc:
            logger.warning("usage rows left in %s for the sweeper: %s", self._path, exc)
            return
        self.queue.clear()
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1

    def counts(self) -> dict[str, Any]:
        return {"queued": len(self.queue), "in_flight": len(self.in_flight)}


recorder = Recorder()
