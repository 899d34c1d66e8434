"""This process's usage pipeline: a journal, a queue and a batch writer (:class:`Recorder`).

The request path only appends: a line to this process's journal (a plain ``write(2)``, so
the line is in the kernel and survives ``kill -9`` of the process) and a record to an
in-memory queue. A background task fsyncs the journal, then writes the queue to the store in
batches (:func:`gateway.ledger.usage.store_rows`: nothing is written twice for one request id),
so a row replayed twice is still one row. A process that dies leaves its journal to the sweep
(:func:`gateway.ledger.usage.sweep`).

Each journal is a segment: once everything in it is in the store, a new segment is started
(carrying over the requests still in flight) and the old one deleted, so journals stay small.

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
import errno
import fcntl
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DatabaseError

from control import serving
from gateway import dbthread
from gateway.ledger.usage import (
    Usage,
    interrupted,
    journal_line,
    store_id,
    store_rows,
    sweep,
    write_all,
)
from telemetry import metrics

logger = logging.getLogger(__name__)

# Rotate the journal once it is this big (and everything in it is stored) ...
SEGMENT_BYTES = 4 * 1024 * 1024
# ... or this old.
SEGMENT_SECONDS = 60.0
SWEEP_EVERY_S = 30.0
BATCH = 1000
EVENT_EVERY_S = 60.0
# While the journal cannot be written, a new segment is tried at most this often, and only
# once its disk has this much room (about a hundred requests' lines): a new segment with nothing
# to carry over costs no space at all, and would pass for a recovery on a disk still full.
REOPEN_EVERY_S = 1.0
RESUME_FREE_BYTES = 64 * 1024
JOURNAL_EVENT = "usage/journal"


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
            self._append(journal_line("s", usage))

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
            self._append(journal_line("d", usage))

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
            write_all(self._fd, line)
        except OSError as exc:
            self._journal_failed(exc)

    def note_clamped(self, usage: Usage, clamped: tuple[tuple[str, str], ...]) -> None:
        """An upstream reported counts no row can hold, or more cached tokens than prompt
        tokens; they were clamped. One Event per upstream a minute says so (a broken engine
        would otherwise write one per request)."""
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
                    f"{usage.request_id} ({usage.model}); clamped to 0..{2**31 - 1}, cached "
                    "tokens to the prompt's",
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
            lines = [journal_line("s", usage) for usage in self.in_flight.values()]
            lines += [journal_line("d", usage) for usage in self.queue]
            if lines:
                write_all(fd, b"".join(lines))
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
