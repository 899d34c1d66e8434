"""Usage rows: one per request, written off the request path, exactly once, never lost.

This module holds the row (:class:`Usage`), the journal's line format and how rows reach
the store (:func:`store_rows`, the dead-letter journal), and the sweep that replays the
journals of processes that are gone (:func:`sweep`); this process's own pipeline (journal,
queue, batch writer) is :mod:`gateway.ledger.recorder`.

A request that reaches an engine writes a *start* line first. If the process dies before the
request's *done* line, the sweeper (any web process, at start and every half minute) finds
the dead process's journal — it is no longer locked — writes its rows that are missing, closes
the requests still in flight as ``interrupted``, and deletes the journal. ``SIGTERM`` and a
normal exit flush the queue at exit and close what is still in flight the same way.

A journal's name starts with the id of the store it was written for (``store_id``): a sweep
replays only journals of the store it is connected to, so pointing a checkout at another
database never pours one store's rows into the other.

Numbers from upstreams are data, not trust: every count is clamped to 0..2^31-1 (cached
tokens to the prompt's) before it is written. A batch the store refuses is retried row by
row; a row it still refuses goes to the dead-letter journal (``dead-letter/<store>.jsonl``
beside the journals), is counted in ``llmgw_usage_dead_letters`` and recorded as an Event,
and never holds back the rows behind it. Only an unreachable store (which refuses every row
alike) keeps rows queued for a retry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
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


DEAD_LETTER_DIR = "dead-letter"

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


def journal_line(kind: str, usage: Usage, **extra: Any) -> bytes:
    # vars(), not dataclasses.asdict(): the fields are flat, and asdict's recursive deep copy
    # cost ~170 us per call. orjson: 1.7 us a line against 7.4 us for json.dumps (measured),
    # which with the 0.5 us write(2) is cheap enough to journal both lines on the request path.
    entry = {"t": kind, **vars(usage), **extra}
    try:
        return orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        # A string orjson will not encode (a lone surrogate in a model name a client sent).
        return json.dumps(entry, separators=(",", ":")).encode() + b"\n"


def write_all(fd: int, data: bytes) -> None:
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
            os.write(fd, journal_line("x", record, error=error))
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
