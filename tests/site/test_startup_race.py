"""[S9] Control planes started at the same instant on a fresh store: every one of them comes
up, what a start-up creates (the schema, the admin user, the demo model and its profile) exists
exactly once, and of the demo keys each run issues, one (the last) is still good.

Each round makes a fresh store (an SQLite file, or a PostgreSQL database of its own) and four
real ``manage.py run`` processes on it, each with its own port and var folder. A process loads
Django, then waits at a barrier (a connection to the test, which answers all four at once) and
only then runs the command, as ``manage.py`` would: the four reach the store in the same
instant instead of whenever their imports happen to finish.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from control import node_tokens
from control.models import Event, Node
from gateway.identity.keys import hash_key
from llmgw_site import startup
from tests.harness.procs import Proc, free_port
from tests.harness.racers import at_once
from tests.harness.store import process_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.store]

PROCESSES = 4
# Rounds, each a test of its own (a few seconds of both cores). A start-up that was not
# serialized failed the first round on either backend, at its migrations, and, with only its
# migrations serialized, at the administrator ("auth_user_username_key").
ROUNDS = 6
BANNER_END = "Ctrl-C stops everything"

# What each process runs: Django loaded, the command's module imported, then the barrier, then
# the command exactly as manage.py runs it.
BARRIER_THEN_RUN = """
import os, socket, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
import django
django.setup()
from django.core.management import execute_from_command_line
import llmgw_site.management.commands.run
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as barrier:
    barrier.recv(1)
execute_from_command_line(["manage.py", *sys.argv[2:]])
"""

Query = Callable[[str], list[tuple[Any, ...]]]


@contextlib.contextmanager
def fresh_store(tmp_path: Path, round_number: int) -> Iterator[tuple[str, Query]]:
    """A store nobody has used: its URL for the processes, and a way to read it afterwards."""
    settings_dict = connection.settings_dict
    if connection.vendor == "sqlite":
        path = tmp_path / f"round{round_number}.sqlite3"

        def sqlite_query(sql: str) -> list[tuple[Any, ...]]:
            with contextlib.closing(sqlite3.connect(path)) as db:
                return db.execute(sql).fetchall()

        yield f"sqlite:///{path}", sqlite_query
        return
    server: dict[str, Any] = {
        "host": settings_dict.get("HOST") or "127.0.0.1",
        "port": int(settings_dict.get("PORT") or 5432),
        "user": settings_dict.get("USER") or "postgres",
        "password": settings_dict.get("PASSWORD") or None,
    }
    # A name of this run's own (the configured database's, this process's id, the round).
    name = f"{settings_dict['NAME']}_s9_{os.getpid()}_{round_number}"[-63:]
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')

    def postgres_query(sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(dbname=name, **server) as db:
            return db.execute(sql).fetchall()

    auth = server["user"] + (f":{server['password']}" if server["password"] else "")
    try:
        yield f"postgres://{auth}@{server['host']}:{server['port']}/{name}", postgres_query
    finally:
        with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_at_a_barrier(round_dir: Path, database_url: str) -> list[Proc]:
    """Four ``manage.py run --no-agent`` on one store, let go together once all four wait."""
    with socket.create_server(("127.0.0.1", 0)) as barrier:
        barrier.settimeout(120)
        procs = []
        for n in range(PROCESSES):
            port = free_port()
            env = process_env(
                LLMGW_VAR_DIR=str(round_dir / f"var{n}"),
                DATABASE_URL=database_url,
                LLMGW_WEB_PROCESSES="1",
            )
            env.pop("REDIS_URL", None)
            argv = [sys.executable, "-c", BARRIER_THEN_RUN, str(barrier.getsockname()[1])]
            argv += ["run", "--no-agent", "--port", str(port)]
            procs.append(Proc(f"run{n}", argv, round_dir / "logs", env, port=port).start())
        waiting = []
        try:
            for _ in procs:
                waiting.append(barrier.accept()[0])
            for held in waiting:
                held.sendall(b"!")
        finally:
            for held in waiting:
                held.close()
    return procs


def serving_healthz(proc: Proc) -> bool:
    try:
        response = httpx.get(f"{proc.url}/healthz", timeout=10)
    except httpx.TransportError:
        return False
    return response.status_code == 200 and response.json().get("database") == "reachable"


def up(proc: Proc, *, serve: bool) -> bool:
    """Its start-up done and its children started (its signal handlers are in place only
    then); with ``serve``, answering /healthz as well."""
    if "started beat" not in proc.log():
        return False
    return serving_healthz(proc) if serve else True


def one_round(round_dir: Path, database_url: str, *, serve: bool) -> list[str]:
    """Four started together, each up, then stopped: their logs. Every one exits 0 and none
    logged a traceback. Without ``serve``, each is stopped as soon as it is up (its children
    have barely begun: the round costs little more than the four start-ups)."""
    procs = start_at_a_barrier(round_dir, database_url)
    # One SIGTERM each: a second could reach a process already past its handlers.
    starting = list(procs)

    def stop_those_up() -> bool:
        ready = [proc for proc in starting if up(proc, serve=serve)]
        if serve and len(ready) < len(starting):
            return False  # all four serve at once before any stops
        for proc in ready:
            proc.signal(signal.SIGTERM)
            starting.remove(proc)
        return not starting

    try:
        wait_until(stop_those_up, what=f"{round_dir.name}: all up", logs=procs, running=starting)
    finally:
        for proc in starting:
            proc.signal(signal.SIGTERM)
        codes = [exit_code(proc) for proc in procs]
    logs = [proc.log() for proc in procs]
    where = f"{round_dir.name}:\n" + "\n".join(f"--- {p.name} ---\n{p.tail(60)}" for p in procs)
    assert codes == [0] * PROCESSES, where
    assert not [log for log in logs if "Traceback" in log], where
    assert all(BANNER_END in log for log in logs), where
    return logs


def exit_code(proc: Proc) -> int | None:
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


def created_once(logs: list[str], query: Query, migrations: int) -> None:
    """What the four start-ups made on their store: each thing once."""
    # One administrator; its password printed once, by the process that made it.
    assert query("SELECT username, is_superuser FROM auth_user") == [("admin", True)]
    told = [re.findall(r"admin user:    admin / (\S+)", log) for log in logs]
    assert sorted(len(t) for t in told) == [0] * (PROCESSES - 1) + [1], logs
    exists = "admin user:    admin (its password was shown when it was created)"
    assert sum(exists in log for log in logs) == PROCESSES - 1, logs

    # One demo model on its one profile, added once.
    assert query("SELECT name FROM control_servedmodel") == [("demo",)]
    assert query("SELECT name FROM control_profile") == [("sim-demo",)]
    assert query("SELECT count(*) FROM control_event WHERE subject = 'model/demo'") == [(1,)]

    # Every process issued a key of its own and revoked the one before: one is still good,
    # and it is one of the keys printed.
    printed = [re.findall(r"API key:\s+(\S+)", log) for log in logs]
    assert all(len(p) == 1 for p in printed), logs
    demo = "FROM gateway_apikey WHERE name = 'make run demo'"
    assert query(f"SELECT count(*) {demo}") == [(PROCESSES,)]
    active = query(f"SELECT key_hash {demo} AND revoked_at IS NULL")
    assert len(active) == 1
    assert active[0][0] in {hash_key(p[0]) for p in printed}

    # Every migration applied once.
    recorded = query("SELECT count(*), count(DISTINCT app || '.' || name) FROM django_migrations")
    assert recorded == [(migrations, migrations)]


@pytest.mark.parametrize("round_number", range(ROUNDS))
def test_s9_control_planes_started_together_on_a_fresh_store_all_come_up_and_create_once(
    tmp_path: Path, round_number: int
) -> None:
    migrations = len(MigrationLoader(None, ignore_no_migrations=True).disk_migrations)
    with fresh_store(tmp_path, round_number) as (database_url, query):
        # The first round serves too: every web process answers /healthz on its store.
        logs = one_round(tmp_path / f"round{round_number}", database_url, serve=round_number == 0)
        created_once(logs, query, migrations)


@pytest.mark.django_db(transaction=True)
def test_s9_the_local_nodes_token_issued_by_four_at_once_is_one_node_holding_one_of_them() -> None:
    """What ``run`` does for its local agent, by four at the same instant, over many rounds:
    one node row, registered once, holding one of the four tokens; none of them fails."""
    for round_number in range(10):
        name = f"local{round_number}"
        tokens = at_once(PROCESSES, functools.partial(node_tokens.issue_node_token, name))
        assert all(isinstance(t, str) for t in tokens), tokens
        (node,) = Node.objects.filter(name=name)
        assert node.token_hash in {node_tokens.hash_token(str(t)) for t in tokens}
        events = Event.objects.filter(subject=f"node/{name}").values_list("message", flat=True)
        assert len(events) == PROCESSES
        assert sum("node registered" in message for message in events) == 1


@pytest.mark.django_db(transaction=True)
def test_s9_the_start_up_lock_lets_one_in_at_a_time_and_the_others_say_they_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eight holders at once, on this backend's lock: their turns never overlap, each after the
    first logs that it waits, and nothing of the lock is left beside the store."""
    turns: list[tuple[str, int]] = []

    def hold() -> None:
        with startup.one_at_a_time():
            me = threading.get_ident()
            turns.append(("in", me))
            time.sleep(0.02)  # long enough that turns without the lock would overlap
            turns.append(("out", me))

    with caplog.at_level(logging.INFO, logger="llmgw_site.startup"):
        assert at_once(8, hold) == [None] * 8
    assert [kind for kind, _ in turns] == ["in", "out"] * 8
    assert [who for _, who in turns[::2]] == [who for _, who in turns[1::2]]
    assert caplog.text.count(startup.WAITING) >= 1
    if connection.vendor == "sqlite":
        assert not Path(f"{connection.settings_dict['NAME']}-startup-lock").exists()
