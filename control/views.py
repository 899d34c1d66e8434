"""The control plane's health: what ``/healthz`` answers (``llmgw_site.asgi.healthz``)."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection


def _database_reachable() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        return True
    except DatabaseError:
        connection.close_if_unusable_or_obsolete()
        return False


async def health() -> tuple[int, dict[str, str]]:
    """Liveness and readiness for load balancers: 200 when the store answers, else 503."""
    reachable = await sync_to_async(_database_reachable)()
    return 200 if reachable else 503, {
        "status": "ok" if reachable else "degraded",
        "version": settings.LLMGW_VERSION,
        "database": "reachable" if reachable else "unreachable",
    }
