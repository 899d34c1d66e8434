"""The store under test, as the test's own connection and the real processes it starts see it."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from django.core.management import call_command
from django.db import connection
from pytest_django import DjangoDbBlocker

from tests.harness.proxy import TcpProxy


def database_url_for_children() -> str:
    """The URL of the *test* database, for real processes a test starts."""
    settings_dict = connection.settings_dict
    # Before the test database exists the settings still name the real one: never hand that
    # to a process (a module-scoped fixture must ask for ``django_db_setup`` first).
    assert settings_dict["NAME"] == settings_dict["TEST"]["NAME"], "no test database yet"
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = settings_dict.get("USER") or "postgres"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or "5432"
    password = settings_dict.get("PASSWORD")
    auth = f"{user}:{password}" if password else user
    return f"postgres://{auth}@{host}:{port}/{settings_dict['NAME']}"


def process_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts that needs no store of the test's. Not the
    test process's metrics folder: a process started with ``LLMGW_VAR_DIR`` keeps its metrics
    there, as ``manage.py run``'s processes do under theirs."""
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.setdefault("SECRET_KEY", "llmgw-checks-only-not-a-secret")
    env.update(extra)
    return env


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts on the test database."""
    return process_env(DATABASE_URL=database_url_for_children(), **extra)


@contextmanager
def unreachable_store(close: Callable[[], None] | None = None) -> Iterator[None]:
    """For the block, the default connection points at a store that cannot be reached, for
    real: PostgreSQL, a closed port on loopback (connection refused); SQLite, a file in a folder
    that does not exist (unable to open database file). ``close`` closes, on the way in and
    out, the connections that would otherwise go on using the real store (this thread's)."""
    close = close or _close_this_threads
    saved = dict(connection.settings_dict)
    close()
    if connection.vendor == "postgresql":
        connection.settings_dict.update(HOST="127.0.0.1", PORT="1")
    else:
        connection.settings_dict["NAME"] = "/nonexistent-llmgw-dir/store.sqlite3"
    try:
        yield
    finally:
        close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def _close_this_threads() -> None:
    connection.close()  # looked up when called: each thread has a connection of its own


def store_behind_proxy(env: dict[str, str]) -> TcpProxy | None:
    """A proxy between the processes started with ``env`` and the test's PostgreSQL, their
    ``DATABASE_URL`` pointed at it, so that a test can cut or slow their store alone (None on
    SQLite: a file has no connection to cut)."""
    if connection.vendor != "postgresql":
        return None
    proxy = TcpProxy(int(connection.settings_dict.get("PORT") or 5432))
    env["DATABASE_URL"] = re.sub(r":\d+/", f":{proxy.port}/", env["DATABASE_URL"])
    return proxy


@contextmanager
def module_store(blocker: DjangoDbBlocker) -> Iterator[None]:
    """The test database open to a whole module whose processes outlive a test (a cluster
    started once): no per-test flush under their feet; the module resets what it needs
    between tests, and the tables are emptied when the module is done."""
    with blocker.unblock():
        try:
            yield
        finally:
            connection.close()
            call_command("flush", interactive=False, verbosity=0)


# --------------------------------------------------------------------------- PostgreSQL only


def _connect(**options: Any) -> psycopg.Connection[Any]:
    settings = connection.settings_dict
    return psycopg.connect(
        host=settings.get("HOST") or "127.0.0.1",
        port=int(settings.get("PORT") or 5432),
        user=settings.get("USER") or "postgres",
        dbname=settings["NAME"],
        **options,
    )


@contextmanager
def table_locked(table: str, *then: str, mode: str = "ACCESS EXCLUSIVE") -> Iterator[None]:
    """Hold a lock on ``table`` from a connection of its own: every tick that touches it
    waits, as a slow store would make it. Statements in ``then`` run in the same transaction
    and commit with the release, so the waiting tick sees them."""
    with _connect() as conn:
        conn.execute(f"LOCK TABLE {table} IN {mode} MODE")
        for statement in then:
            conn.execute(statement)
        yield
        conn.commit()


def execute_now(sql: str, params: tuple[Any, ...] = ()) -> Any:
    """Run one statement on a connection of its own, committed at once (while the test's own
    connection may be waiting on a lock)."""
    with _connect(autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchone() if cursor.description else None


def settle_own_transactions(timeout: float = 10.0) -> None:
    """Until no other session of this test process (a thread it left working: a stream's end
    still being written, a servicer being stopped) is inside a transaction on the test
    database. The flush after a transactional test truncates every table, and one that met such
    a transaction deadlocked with it (seen: a gRPC listener stopped as its test ended, its last
    stream's close still writing). Sessions of other processes are their test's business."""
    if connection.vendor != "postgresql":
        return
    busy = (
        "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state <> 'idle'"
    )
    deadline = time.monotonic() + timeout
    with _connect(autocommit=True) as conn:
        while time.monotonic() < deadline:
            ports = {row[0] for row in conn.execute(busy).fetchall()}
            if not ports & own_tcp_ports():
                return
            time.sleep(0.05)


def own_tcp_ports() -> set[int]:
    """The local ports of this process's TCP sockets (from /proc: Linux only)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
