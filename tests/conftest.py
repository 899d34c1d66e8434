"""Shared fixtures. Every test that touches the store runs on whichever backend DATABASE_URL
names (the Makefile runs the suite once on SQLite and once on PostgreSQL)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from pytest_django.fixtures import _set_suffix_to_test_databases

from tests.harness.clock import FakeClock


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """One test database per pytest run, so runs side by side (two checkouts, a developer and
    an editor's test runner) never create or drop each other's database."""
    _set_suffix_to_test_databases(os.environ.get("LLMGW_TEST_DB_SUFFIX") or f"p{os.getpid()}")


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
