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

A journal's name starts with the id of the store it was written for (``store_id``): a sweep
replays only journals of the store it is connected to, so pointing a checkout at another
database never pours one store's rows into the other.

Numbers from upstreams are data, not trust: every count is clamped to 0..2^31-1 before it is
written. A batch the store refuses is retried row by row; a row it still refuses goes to the
dead-letter journal (``dead-letter/<store>.jsonl`` beside the journals), is counted in
``llmgw_usage_dead_letters`` and recorded as an Event, and never holds back the rows behind
it. Only an unreachable store (which refuses every row alike) keeps rows queued for a retry.

A journal that cannot be written (its disk full: ENOSPC, or any other write, fsync or open
error) does not stop requests: they are served, and their rows go straight to the store (the
writer is woken by every finished request instead of waiting for its interval). The process
says so loudly: ``llmgw_usage_journal_unwritable`` is 1, ``llmgw_usage_journal_errors`` counts
each failure, an error line and an Event name the journal. What is at risk meanwhile is only
what a journal is for: rows not yet stored when the process dies. The segment that failed is
never appended to again (a short write may have cut its last line, and the next line would be
read back glued to it); the writer tries a new segment about once a second, carrying over the
requests in flight and the rows not yet stored, and once one is written the old one is deleted,
the gauge is 0 and an Event says so: recording resumes by itself when space returns.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
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
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    transaction,
)
from django.utils import timezone

from control import serving
from gateway import dbthread
from gateway.ledger import traffic
from gateway.models import ApiKey, UsageRecord
from telemetry import metrics

logger = logging.getLogger(__name__)

# Every reported count is clamped to this (PostgreSQL's integer, and far past any real request).
MAX_COUNT = 2**31 - 1


def clamp_count(value: Any) -> int:
    """A token count as a row can hold it: an integer in 0..2^31-1 (pure)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return 0
    return min(value, MAX_COUNT)


# Rotate the journal once it is this big (and everything in it is stored) ...
SEGMENT_BYTES = 4 * 1024 * 1024
# ... or this old.
SEGMENT_SECONDS = 60.0
SWEEP_EVERY_S = 30.0
BATCH = 1000
DEAD_LETTER_DIR = "dead-letter"
EVENT_EVERY_S = 60.0
# While the journal cannot be written, a new segment is tried at most this often, and only
# once its disk has this much room (about a hundred requests' lines): a new segment with nothing
# to carry over costs no space at all, and would pass for a recovery on a disk still full.
REOPEN_EVERY_S = 1.0
RESUME_FREE_BYTES = 64 * 1024
JOURNAL_EVENT = "usage/journal"
# The store is not there (down, unreachable, locked): every row would fail alike, so rows stay
# queued and journaled for a later try instead of being judged one by one.
_STORE_DOWN = (OperationalError, InterfaceError)


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
    source: str = ""  # engine | tokenized | estimated
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
            # Clamped again here: a journal written before counts were checked must replay.
            clamp_count(self.prompt_tokens),
            clamp_count(self.completion_tokens),
            clamp_count(self.cached_tokens),
            self.source[:10],
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
    "usage_source",
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
assert set(COLUMNS) == _MODEL_COLUMNS, "UsageRecord changed: update gateway.ledger.usage.COLUMNS"


def _line(kind: str, usage: Usage, **extra: Any) -> bytes:
    # vars(), not dataclasses.asdict(): the fields are flat, and asdict's recursive deep copy
    # cost ~170 us per call. orjson: 1.7 us a line against 7.4 us for json.dumps (measured),
    # which with the 0.5 us write(2) is cheap enough to journal both lines on the request path.
    entry = {"t": kind, **vars(usage), **extra}
    try:
        return orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        # A string orjson will not encode (a lone surrogate in a model name a client sent).
        return json.dumps(entry, separators=(",", ":")).encode() + b"\n"


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data``, or OSError: a short write (a disk filling up) is an error too."""
    written = os.write(fd, data)
    if written != len(data):
        _write_rest(fd, data, written)


def _write_rest(fd: int, data: bytes, written: int) -> None:
    view = memoryview(data)[written:]
    while view:
        written = os.write(fd, view)
        if written == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def store_id() -> str:
    """Which store this process writes to: its engine, host, port and database name, hashed.
    Journals carry it in their names so that each is replayed only into its own store."""
    config = connection.settings_dict
    name = str(config.get("NAME") or "")
    if connection.vendor == "sqlite" and name and not name.startswith((":memory:", "file:")):
        name = os.path.realpath(name)
    raw = f"{connection.vendor}|{config.get('HOST') or ''}|{config.get('PORT') or ''}|{name}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def store_rows(records: Iterable[Usage], directory: Path | None = None) -> int:
    """Write rows that are not there yet (in the background lane of gateway.dbthread, or at
    exit and in ``replay_usage``). Returns how many rows were dealt with: stored, or refused by
    the store and set aside in the dead-letter journal under ``directory`` (default: the
    journal folder). Raises only when the store cannot be reached, leaving the rows to be tried
    again."""
    dbthread.ready()
    records = list(records)
    if not records:
        return 0
    created_at = connection.ops.adapt_datetimefield_value(timezone.now())
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.executemany(INSERT_SQL, [r.values(created_at) for r in records])
    except _STORE_DOWN:
        raise
    except Exception:
        # One row the store refuses fails its whole batch: find it, and keep the others.
        _store_one_by_one(records, created_at, directory)
    keys = {r.api_key_id for r in records if r.api_key_id is not None}
    if keys:
        # Coalesced here rather than written by each request.
        last = datetime.fromtimestamp(max(_finite(r.started_at) for r in records), tz=UTC)
        ApiKey.objects.filter(pk__in=keys).update(last_used_at=last)
    return len(records)


def _finite(timestamp: float) -> float:
    return timestamp if 0 <= timestamp < 32503680000 else time.time()  # before year 3000


def _store_one_by_one(records: list[Usage], created_at: Any, directory: Path | None) -> None:
    refused: list[tuple[Usage, str]] = []
    for record in records:
        try:
            _insert_one(record, created_at)
        except _STORE_DOWN:
            raise
        except IntegrityError:
            # A key or user deleted while its requests were queued: keep the row, as the
            # foreign keys' SET_NULL would have. Anything else it breaks is the row's own.
            try:
                _insert_one(_without_deleted_owners([record])[0], created_at)
            except _STORE_DOWN:
                raise
            except Exception as exc:
                refused.append((record, _describe(exc)))
        except Exception as exc:
            refused.append((record, _describe(exc)))
    if refused:
        dead_letter(refused, directory)


def _insert_one(record: Usage, created_at: Any) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(INSERT_SQL, record.values(created_at))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def dead_letter(refused: list[tuple[Usage, str]], directory: Path | None = None) -> None:
    """Set rows the store refused aside: a line each in the dead-letter journal (kept for an
    operator to read and fix, never replayed by itself), the metric, and one Event."""
    journals = directory or Path(settings.LLMGW_USAGE_JOURNAL_DIR)
    folder = journals / DEAD_LETTER_DIR
    # Owner-only (the rows name keys, users and models), both levels: the parents mkdir makes
    # get the umask's mode, not this one.
    journals.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{store_id()}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for record, error in refused:
            os.write(fd, _line("x", record, error=error))
        os.fsync(fd)
    finally:
        os.close(fd)
    metrics.USAGE_DEAD_LETTERS.inc(len(refused))
    first, error = refused[0]
    logger.error("%d usage rows refused by the store, kept in %s: %s", len(refused), path, error)
    with contextlib.suppress(DatabaseError):
        serving.record_gateway_event(
            f"usage/{first.upstream or first.endpoint}"[:200],
            f"{len(refused)} usage row(s) refused by the store and kept in the dead-letter "
            f"journal {path.name}: {error}",
            {"request_ids": [r.request_id for r, _ in refused[:20]], "file": str(path)},
        )


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


_FIELDS = frozenset(f.name for f in dataclasses.fields(Usage))


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
                # Fields this version does not know (a newer one wrote the line) are dropped
                # rather than costing the row.
                usage = Usage(**{k: v for k, v in entry.items() if k in _FIELDS})
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a line cut short by a crash: its request has another line or none
            (done if kind == "d" else started)[usage.request_id] = usage
    now = time.time()
    rows = list(done.values())
    rows += [interrupted(s, now) for rid, s in started.items() if rid not in done]
    return rows


def sweep(directory: Path) -> int:
    """Replay and delete the journals of processes that are gone, for this store only.
    Returns rows replayed. Never raises for a journal: one that cannot be replayed now (the
    store is down) stays for the next sweep, so start-up is never held up by it."""
    replayed = 0
    if not directory.is_dir():
        return 0
    mine = store_id()
    for path in sorted(directory.glob("*.journal")):
        if not path.name.startswith(mine + "."):
            _note_foreign(path)
            continue
        try:
            replayed += _replay(path, directory)
        except Exception as exc:
            logger.warning("usage journal %s not replayed yet: %s", path.name, _describe(exc))
            if isinstance(exc, _STORE_DOWN):
                break  # the others would fail alike
    return replayed


_foreign_noted: set[str] = set()


def _note_foreign(path: Path) -> None:
    if path.name not in _foreign_noted:
        _foreign_noted.add(path.name)
        logger.warning(
            "usage journal %s was written for another store; left for that store", path.name
        )


def _replay(path: Path, directory: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0  # another sweeper took it
    try:
        try:
            # The owner holds this lock for its whole life: getting it means the owner died.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        if not path.exists():
            return 0
        rows = read_journal(path)
        store_rows(rows, directory)
        path.unlink()
        if rows:
            traffic.forget_settled()
        logger.info("replayed %d usage rows from %s", len(rows), path.name)
        return len(rows)
    finally:
        os.close(fd)


def _write_events(events: list[tuple[str, str, dict[str, Any]]]) -> None:
    dbthread.ready()
    for subject, message, data in events:
        logger.warning("%s: %s", subject, message)
        try:
            serving.record_gateway_event(subject, message, data)
        except DatabaseError as exc:
            logger.warning("event not recorded: %s", exc)


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
        # Why the journal cannot be written now ("" while it can), and when a new segment was
        # last tried; whether its failure Event was sent (so that the recovery gets one too).
        self.journal_error = ""
        self._reopen_at = 0.0
        self._failure_told = False
        # Events to write with the next batch (bounded), and when each subject last had one.
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self._event_at: dict[str, float] = {}

    # --- the request path: appends only -------------------------------------------------

    def start(self, usage: Usage) -> None:
        """The request is about to reach an engine: from now on it must end up as a row."""
        journal = self._journal_ready()
        self.in_flight[usage.request_id] = usage
        if journal:
            self._append(_line("s", usage))

    def finish(self, usage: Usage) -> None:
        self._done(usage)
        # Without a journal the row is only in memory: to the store now, not at the interval.
        if (len(self.queue) >= BATCH or self.journal_error) and self._wake is not None:
            self._wake.set()

    def _done(self, usage: Usage) -> None:
        journal = self._journal_ready()
        self.in_flight.pop(usage.request_id, None)
        self.queue.append(usage)
        if journal:
            self._append(_line("d", usage))

    def _journal_ready(self) -> bool:
        """Whether lines can go to the journal now (its first segment opened if need be). A
        journal that cannot be written is told (``_journal_failed``), never raised to the
        request: its rows go straight to the store."""
        if self.journal_error:
            return False
        try:
            self._ensure_journal()
        except OSError as exc:
            self._journal_failed(exc)
            return False
        return True

    def _append(self, line: bytes) -> None:
        try:
            _write_all(self._fd, line)
        except OSError as exc:
            self._journal_failed(exc)

    def note_clamped(self, usage: Usage, clamped: tuple[tuple[str, str], ...]) -> None:
        """An upstream reported counts no row can hold; they were clamped. One Event per
        upstream a minute says so (a broken engine would otherwise write one per request)."""
        metrics.USAGE_CLAMPED.inc(len(clamped))
        subject = f"upstream/{usage.upstream or usage.endpoint}"
        now = time.monotonic()
        if now - self._event_at.get(subject, -EVENT_EVERY_S) < EVENT_EVERY_S:
            return
        self._event_at[subject] = now
        if len(self.events) < 100:
            reported = ", ".join(f"{name}={value}" for name, value in clamped)
            self.events.append(
                (
                    subject,
                    f"{usage.upstream or 'an upstream'} reported {reported} for request "
                    f"{usage.request_id} ({usage.model}); clamped to 0..{2**31 - 1}",
                    {"request_id": usage.request_id, "reported": dict(clamped)},
                )
            )

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
                    await dbthread.in_background(sweep, self.directory())
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
        if self.journal_error:
            self._try_new_segment()
        if self.events:
            events, self.events = self.events, []
            await dbthread.in_background(_write_events, events)
        if not self.queue:
            return 0
        batch = self.queue[:]
        fd = -1 if self.journal_error else self._fd
        unsynced = await dbthread.in_background(self._durable_store, fd, batch)
        if unsynced is not None:
            self._journal_failed(unsynced)
        # Only what was stored leaves the queue; records added meanwhile stay.
        del self.queue[: len(batch)]
        self._maybe_rotate()
        return len(batch)

    @staticmethod
    def _durable_store(fd: int, batch: list[Usage]) -> OSError | None:
        """Store ``batch``, the journal made durable first; the fsync's error, if it failed
        (the kernel may have dropped what it could not write, so the segment proves nothing
        now: the rows go to the store all the same)."""
        unsynced = None
        if fd >= 0:
            try:
                os.fsync(fd)  # the journal first: once durable, losing the store loses nothing
            except OSError as exc:
                unsynced = exc
        store_rows(batch)
        return unsynced

    # --- the journal -------------------------------------------------------------------------

    def directory(self) -> Path:
        return Path(settings.LLMGW_USAGE_JOURNAL_DIR)

    def _ensure_journal(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            return
        self._open_segment()

    def _open_segment(self) -> None:
        """Start a new segment: the requests in flight and the rows not yet stored are carried
        over, so the old segment can go. On OSError nothing changed (the new file is gone)."""
        directory = self.directory()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        pid = os.getpid()
        path = directory / f"{store_id()}.{pid}-{secrets.token_hex(4)}.journal"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        old_fd, old_path = self._fd, self._path
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            lines = [_line("s", usage) for usage in self.in_flight.values()]
            lines += [_line("d", usage) for usage in self.queue]
            if lines:
                _write_all(fd, b"".join(lines))
            if old_fd >= 0:
                os.fsync(fd)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._pid = pid
        self._fd, self._path, self._segment_started = fd, path, time.monotonic()
        if old_fd >= 0 and old_path is not None:
            old_path.unlink(missing_ok=True)
            os.close(old_fd)

    def _maybe_rotate(self) -> None:
        if self._fd < 0 or self._path is None or self.journal_error:
            return
        age = time.monotonic() - self._segment_started
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            size = SEGMENT_BYTES
        if size >= SEGMENT_BYTES or (age >= SEGMENT_SECONDS and size > 0):
            try:
                self._open_segment()
            except OSError as exc:
                # The segment in use is whole: keep appending to it, rotate later.
                metrics.USAGE_JOURNAL_ERRORS.inc()
                logger.warning("usage journal not rotated yet: %s", exc)

    def _journal_failed(self, exc: OSError) -> None:
        """The journal cannot be written: stop writing to this segment and say so, once."""
        metrics.USAGE_JOURNAL_ERRORS.inc()
        if self.journal_error:
            return
        self.journal_error = f"{type(exc).__name__}: {exc}"[:300]
        self._reopen_at = time.monotonic() + REOPEN_EVERY_S
        metrics.USAGE_JOURNAL_UNWRITABLE.set(1)
        where = str(self._path or self.directory())
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        logger.error(
            "usage journal %s cannot be written (%s): requests are served and their rows "
            "written straight to the store; rows not yet stored are lost if this process "
            "dies before the journal is writable again",
            where,
            self.journal_error,
        )
        now = time.monotonic()
        if now - self._event_at.get(JOURNAL_EVENT, -EVENT_EVERY_S) >= EVENT_EVERY_S:
            self._event_at[JOURNAL_EVENT] = now
            self._failure_told = True
            cause = "its disk is full" if full else "the write failed"
            self.events.append(
                (
                    JOURNAL_EVENT,
                    f"usage journal {where} cannot be written, {cause} ({self.journal_error}): "
                    "requests are served and their usage rows written straight to the store "
                    "until it can be written again",
                    {"file": where, "error": self.journal_error, "pid": os.getpid()},
                )
            )

    def _try_new_segment(self) -> None:
        """While the journal cannot be written, about once a second: a new segment with the
        requests in flight and the rows not yet stored. Written whole, it is the journal again."""
        now = time.monotonic()
        if now < self._reopen_at:
            return
        self._reopen_at = now + REOPEN_EVERY_S
        try:
            disk = os.statvfs(self.directory())
            if disk.f_bavail * disk.f_frsize < RESUME_FREE_BYTES:
                raise OSError(errno.ENOSPC, f"under {RESUME_FREE_BYTES // 1024} KiB free")
            self._open_segment()
        except OSError as exc:
            metrics.USAGE_JOURNAL_ERRORS.inc()
            logger.debug("usage journal still cannot be written: %s", exc)
            return
        was, self.journal_error = self.journal_error, ""
        metrics.USAGE_JOURNAL_UNWRITABLE.set(0)
        logger.warning("usage journal %s is written again (it failed: %s)", self._path, was)
        if self._failure_told:
            self._failure_told = False
            self.events.append(
                (
                    JOURNAL_EVENT,
                    f"usage journal {self._path} is written again; recording is journaled as "
                    "before",
                    {"file": str(self._path), "pid": os.getpid()},
                )
            )

    def close(self) -> None:
        """At exit (SIGTERM included): store everything, close what is in flight as
        interrupted, and delete the journal. If the store is down the journal stays behind
        for the sweeper."""
        if self._fd >= 0 and self._pid != os.getpid():
            return  # another process's journal
        if self._fd < 0 and not (self.queue or self.in_flight):
            return  # nothing ever recorded
        now = time.time()
        if self.journal_error:
            self._reopen_at = 0.0
            self._try_new_segment()  # the rows are safer in a journal, if there is room now
        for usage in list(self.in_flight.values()):
            self._done(interrupted(usage, now))
        try:
            self._durable_store(-1 if self.journal_error else self._fd, self.queue)
        except Exception as exc:
            if self.journal_error:
                logger.error(
                    "%d usage rows lost: the store refused them (%s) and the journal cannot be "
                    "written (%s)",
                    len(self.queue),
                    exc,
                    self.journal_error,
                )
            else:
                logger.warning("usage rows left in %s for the sweeper: %s", self._path, exc)
            return
        self.queue.clear()
        if self._fd >= 0:
            if self._path is not None:
                self._path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1

    def counts(self) -> dict[str, Any]:
        return {"queued": len(self.queue), "in_flight": len(self.in_flight)}


recorder = Recorder()
