"""Shared fixtures. Every test that touches the store runs on whichever backend DATABASE_URL
names (the Makefile runs the suite once on SQLite and once on PostgreSQL)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from pytest_django.fixtures import _set_suffix_to_test_databases

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """One test database per pytest run, so runs side by side (two checkouts, a developer and
    an editor's test runner) never create or drop each other's database."""
    _set_suffix_to_test_databases(os.environ.get("LLMGW_TEST_DB_SUFFIX") or f"p{os.getpid()}")


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def election_on(settings: Any) -> Any:
    """Leader election on, as with two control planes on one store."""
    settings.LLMGW_LEADER_ELECTION = True
    settings.LLMGW_LEASE_TTL = 10.0
    settings.LLMGW_LEASE_RENEW_DEADLINE = 6.0
    return settings


@pytest.fixture
def store_unreachable() -> Iterator[None]:
    """Point the default connection at a store that cannot be reached, for real.

    PostgreSQL: a closed port on loopback (connection refused). SQLite: a file in a folder that
    does not exist (unable to open database file).
    """
    saved = dict(connection.settings_dict)
    connection.close()
    if connection.vendor == "postgresql":
        connection.settings_dict.update(HOST="127.0.0.1", PORT="1")
    else:
        connection.settings_dict["NAME"] = "/nonexistent-llmgw-dir/store.sqlite3"
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def database_url_for_children() -> str:
    """The URL of the *test* database, for real processes a test starts."""
    settings_dict = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = settings_dict.get("USER") or "postgres"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or "5432"
    password = settings_dict.get("PASSWORD")
    auth = f"{user}:{password}" if password else user
    return f"postgres://{auth}@{host}:{port}/{settings_dict['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DATABASE_URL"] = database_url_for_children()
    env.setdefault("SECRET_KEY", "llmgw-checks-only-not-a-secret")
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    check: Callable[[], Any], timeout: float = 15.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll ``check`` until it returns something truthy, and return that; fail after
    ``timeout`` seconds naming ``what`` and the last result."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last: {last!r}")
