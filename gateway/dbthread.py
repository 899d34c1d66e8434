"""The connection of the thread where ``/v1`` does its database work.

``/v1`` never queries on the event loop: key lookups on a cache miss, the routing table,
limit counters and usage rows run through ``sync_to_async`` in one long-lived thread, outside
Django's request cycle. Django's ``close_old_connections()`` would close that thread's
connection on every call under the default ``CONN_MAX_AGE=0``, a reconnect each time
(docs/decisions.md, 'the database thread's connection'), so the connection is kept and dropped
only once it has failed.
"""

from __future__ import annotations

from django.db import connection


def ready() -> None:
    """Call before database work in the database thread."""
    if connection.connection is None:
        return
    if connection.errors_occurred:
        # The last statement failed: keep the connection only if it still answers.
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()
