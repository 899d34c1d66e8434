"""One start-up at a time on a store: ``manage.py run``'s migrations and creations run alone.

A start-up migrates the store, then creates what a fresh install needs when it is missing (the
administrator, the demo model and its profile) and replaces what each run renews (the demo
key, the local node's token and the file the agent reads it from). Several control planes may
start on one store at the same instant (a deploy that starts them together, a host that boots
them all), and none of those steps is safe beside another process doing the same: Django's
``migrate`` reads which migrations are applied once, so two processes apply the same one and
the second fails (``relation already exists``, a duplicate ``pg_type`` row, ``table already
exists`` on SQLite), and "create it if there is none" lets both see none (``duplicate key
value violates unique constraint "auth_user_username_key"``). Rather than make each step
race-safe on its own (and every step a later change adds), the whole start-up holds one lock
per store: the processes run it one after the other, and every one after the first finds the
store migrated, the administrator and the demo model there, and carries on. ``manage.py
migrate`` takes the same lock (``llmgw_site/management/commands/migrate.py``), so the hosts of a
deploy may each run it at once too.

The lock is the store's, so it serializes control planes on different hosts too:

- PostgreSQL: a transaction-level advisory lock, taken on a connection of its own and held by
  an open transaction until the start-up is done. Not the connection the steps use, which the
  pool hands around; not a session-level lock, which behind a pooler in transaction mode stays
  with whichever client gets the server connection next (an open transaction keeps it pinned).
  The lock ends with the transaction, or with the connection when the process dies. Advisory
  locks are per database: control planes on other databases of one server never wait here.
- SQLite: everyone on the store shares its file system (SQLite locks its own file the same
  way), so an exclusive ``flock`` on a file beside the database (removed as it is let go),
  released when the process exits however it exits. ``BEGIN IMMEDIATE`` would serialize each
  transaction but not the steps between them, and Django refuses to migrate SQLite inside a
  transaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger(__name__)

# The advisory lock's key: fixed, and unlikely to be any other application's on the database.
LOCK_KEY: Final = int.from_bytes(hashlib.sha256(b"llmgw start-up").digest()[:8], "big", signed=True)
WAITING: Final = "another process is starting up on this store; waiting for it to finish"


# The stores whose lock this thread holds: a hold inside a hold (``run`` holding it calls
# ``migrate``, which takes it too) is the same hold, where a second lock would wait for itself.
_held = threading.local()


@contextlib.contextmanager
def one_at_a_time(using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Hold the store's start-up lock for the ``with`` block, waiting for it as long as another
    process holds it (that process is migrating or creating; what it does is what this one
    would do)."""
    held: set[str] = _held.__dict__.setdefault("aliases", set())
    if using in held:
        yield
        return
    wrapper = connections[using]
    if wrapper.vendor == "postgresql":
        lock = _advisory_lock(wrapper)
    elif wrapper.vendor == "sqlite":
        lock = _file_lock(wrapper)
    else:
        raise NotImplementedError(f"no start-up lock for {wrapper.vendor}")
    with lock:
        held.add(using)
        try:
            yield
        finally:
            held.discard(using)


@contextlib.contextmanager
def _advisory_lock(wrapper: BaseDatabaseWrapper) -> Iterator[None]:
    # The same settings without the pool: a connection of its own, closed at the end.
    settings = {**wrapper.settings_dict}
    settings["OPTIONS"] = {k: v for k, v in settings["OPTIONS"].items() if k != "pool"}
    own = type(wrapper)(settings, wrapper.alias)
    try:
        own.set_autocommit(False)
        with own.cursor() as cursor:
            # The server's timeouts are for clients stuck by mistake; this one waits, then sits
            # in its transaction, on purpose, for as long as the start-up takes.
            cursor.execute(
                "SELECT set_config('statement_timeout', '0', true),"
                " set_config('lock_timeout', '0', true),"
                " set_config('idle_in_transaction_session_timeout', '0', true)"
            )
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_KEY])
            if not cursor.fetchone()[0]:
                logger.info(WAITING)
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK_KEY])
        yield
        own.rollback()  # the transaction held only the lock
    finally:
        own.close()


@contextlib.contextmanager
def _file_lock(wrapper: BaseDatabaseWrapper) -> Iterator[None]:
    name = str(wrapper.settings_dict["NAME"])
    if name == ":memory:" or "mode=memory" in name:
        yield  # a store no other process can open
        return
    path = Path(name.removeprefix("file:").split("?", 1)[0] + "-startup-lock")
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                logger.info(WAITING)
                waited = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        # The holder before removes the file as it lets go (so that none is left beside the
        # store): a lock taken on the file it removed is nobody's; take the one there now.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    try:
        yield
    finally:
        # Removed while held: a process that opened it meanwhile finds it gone and tries again.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # the lock goes with the descriptor
