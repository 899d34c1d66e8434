"""One clock for every decision about time that two hosts could disagree on: the database's.

Queries call ``llmgw_clock_ms()``, the store's current time in integer milliseconds since the
Unix epoch. On PostgreSQL it is a SQL function (created by migration ``0002``) over
``clock_timestamp()``; on SQLite, an embedded store that only one host can share, it is the
host's clock, registered on every new connection. The lease SQL is therefore the same text on
both backends.
"""

from __future__ import annotations

import time
from typing import Any

from django.db.backends.signals import connection_created

CLOCK_FUNCTION = "llmgw_clock_ms"

POSTGRES_CREATE = """
CREATE OR REPLACE FUNCTION llmgw_clock_ms() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$
"""
POSTGRES_DROP = "DROP FUNCTION IF EXISTS llmgw_clock_ms()"


def _sqlite_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _register_on_sqlite(sender: Any, connection: Any, **kwargs: Any) -> None:
    if connection.vendor == "sqlite":
        connection.connection.create_function(
            CLOCK_FUNCTION, 0, _sqlite_clock_ms, deterministic=False
        )


def install() -> None:
    """Register the SQLite function on each new connection (PostgreSQL has it from migration)."""
    connection_created.connect(_register_on_sqlite, dispatch_uid="llmgw-dbclock")
