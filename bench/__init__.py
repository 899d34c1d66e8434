"""``make bench``: what llmgw adds over calling the engine directly, and the control
plane's cold start and failover. Run with ``python -m bench``."""

from __future__ import annotations

import os
from pathlib import Path


def django_on(database_url: str, var_dir: Path) -> dict[str, str]:
    """Django set up in this process on ``database_url`` (migrated), its files under
    ``var_dir``; the environment, for the processes a benchmark starts to share."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        SECRET_KEY=env.get("SECRET_KEY") or "llmgw-bench-only",
        LLMGW_VAR_DIR=str(var_dir),
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        LLMGW_LOG_LEVEL="WARNING",
    )
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return env
