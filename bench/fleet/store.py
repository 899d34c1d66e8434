"""What the fleet benchmark reads from PostgreSQL: a fresh database, the writes, commits and
connections its statistics views count, the replicas placed and ready, and the errors its log
shows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PG_LOG = Path("/var/log/postgresql/postgresql-15-main.log")


def fresh_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"database name {name!r}: use lowercase letters, digits, _")
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name}")


def sql(query: str, *params: Any) -> list[tuple[Any, ...]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return list(cursor.fetchall())


def connections_by_app() -> dict[str, int]:
    rows = sql(
        "SELECT application_name, count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() GROUP BY application_name"
    )
    return {str(name): int(n) for name, n in rows}


def table_writes() -> dict[str, int]:
    rows = sql(
        "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables "
        "WHERE relname LIKE 'control_%%'"
    )
    return {str(name): int(n) for name, n in rows}


def node_heartbeat_writes() -> int:
    return int(
        sql("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'control_node'")[0][0]
    )


def committed() -> tuple[int, int]:
    """(transactions committed, sessions opened) in this database so far."""
    row = sql(
        "SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = current_database()"
    )[0]
    return int(row[0]), int(row[1])


def wanted_replicas() -> int:
    from control.models import ServedModel

    return sum(ServedModel.objects.values_list("min_replicas", flat=True))


def replica_counts() -> tuple[int, int]:
    """(running replicas placed, of them ready)."""
    from control.models import Replica

    running = Replica.objects.filter(desired=Replica.Desired.RUNNING)
    return running.count(), running.filter(observed=Replica.Observed.READY).count()


def store_errors(since: int, database: str) -> list[str]:
    """ERROR/FATAL/PANIC lines PostgreSQL logged about ``database`` after byte ``since``."""
    try:
        with PG_LOG.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except OSError:
        return ["(the PostgreSQL log is not readable here)"]
    return [
        line
        for line in text.splitlines()
        if re.search(r"\b(ERROR|FATAL|PANIC):", line) and f"@{database} " in line
    ]


def log_size() -> int:
    try:
        return PG_LOG.stat().st_size
    except OSError:
        return 0
