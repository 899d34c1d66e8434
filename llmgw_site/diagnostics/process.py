"""This process's diagnostics channel (``telemetry.diagnostics``), started by each process of
the deployment: a web process once it serves (``llmgw_site.webserver``), the worker and beat
as Celery starts them (``llmgw_site.celery``). ``LLMGW_DIAGNOSTICS=false`` starts none.

What the site knows and the ground floor does not: where the channels live (the var folder),
what this process is (``LLMGW_PROCESS``), which connections to count (the store's and Redis's,
from the settings) and the store's connection pool, where there is one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connections

from telemetry import diagnostics
from telemetry.vitals import Peer

logger = logging.getLogger(__name__)


def folder() -> Path:
    """Where every process of this host keeps its channel's socket."""
    return Path(settings.VAR_DIR) / "diagnostics"


def peers(database: Mapping[str, Any], redis_url: str) -> tuple[Peer, ...]:
    """The store (``database``: its settings) and Redis, as this process reaches them: an
    SQLite file, or a host and port (a Unix socket's peer cannot be told apart, so it is not
    counted)."""
    found: list[Peer] = []
    if database["ENGINE"] == "django.db.backends.sqlite3":
        found.append(Peer("store", path=str(database["NAME"])))
    else:
        host = str(database.get("HOST") or "")
        port = int(database.get("PORT") or 5432)
        found.append(
            Peer("store", host=host, port=port) if host and host[0] != "/" else Peer("store")
        )
    if redis_url:
        redis = urlsplit(redis_url)
        found.append(
            Peer("redis", host=redis.hostname or "", port=redis.port or 6379)
            if redis.scheme in {"redis", "rediss"}
            else Peer("redis")
        )
    return tuple(found)


def store_pool() -> dict[str, Any] | None:
    """The store's connection pool (PostgreSQL with ``LLMGW_DB_POOL_MAX``): its size, the
    connections free in it and the requests waiting for one; None without a pool."""
    pool = getattr(connections["default"], "pool", None)
    return dict(pool.get_stats()) if pool is not None else None


def start(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Answer diagnostic requests for this process from now on (``loop``: its event loop, whose
    tasks and lag are then reported too). A channel that cannot be opened is logged and left:
    the process serves on without it."""
    if not settings.LLMGW_DIAGNOSTICS:
        return
    process = diagnostics.Process(
        settings.LLMGW_PROCESS,
        loop=loop,
        peers=peers(settings.DATABASES["default"], settings.REDIS_URL),
        extras={"store_pool": store_pool},
    )
    try:
        channel = diagnostics.serve(folder(), process)
    except OSError as exc:
        logger.warning("diagnostics: cannot listen in %s: %s", folder(), exc.strerror or exc)
        return
    logger.info("diagnostics: %s answers on %s", settings.LLMGW_PROCESS, channel.path)
