"""``make bench``: what llmgw adds over calling the engine directly, and the control
plane's cold start and failover. Run with ``python -m bench``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User and system CPU of one process so far, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``q`` (0 to 1) of ``values``; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mib(pid: int) -> float:
    """Resident memory of one process, from /proc (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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


def fresh_store(work: Path, user: str) -> tuple[dict[str, str], str]:
    """``work`` emptied, a SQLite store in it (migrated) with one key of ``user``'s; the
    environment every process the benchmark starts gets, and the key."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = django_on(f"sqlite:///{work / (user + '.sqlite3')}", work)
    from tests.harness.factories import make_key

    key, _ = make_key(user)
    return env, key
