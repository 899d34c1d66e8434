"""Shared fixtures. Every test that touches the store runs on whichever backend DATABASE_URL
names: the Makefile runs the suite on SQLite, then the tests that use the store again on
PostgreSQL (``--store-tests-only``: the others would only repeat themselves)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from pytest_django import DjangoDbBlocker
from pytest_django.fixtures import _set_suffix_to_test_databases

from tests.harness.clock import FakeClock
from tests.harness.redis import RedisServer
from tests.harness.store import own_tcp_ports, unreachable_store

STORE_FIXTURES = {"django_db_setup"}  # every way to the test database goes through it
STORELESS = pytest.StashKey[int]()  # how many tests --store-tests-only left out


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-tests-only",
        action="store_true",
        help="run only the tests that use the store: the second backend's pass, the others "
        "having run in the first",
    )


def pytest_configure(config: pytest.Config) -> None:
    """No connection pool in the test runner itself: pytest-django creates and drops the test
    database around connections held by threads it does not know (the async ORM's, the
    streams' store threads), which a pool keeps open. The processes tests start use the pool
    as a deployment would.

    Passwords are hashed with few rounds (tests.harness.passwords): the real cost is a second
    of CPU per user, and the suite makes hundreds."""
    from django.conf import settings

    settings.DATABASES["default"].get("OPTIONS", {}).pop("pool", None)
    settings.PASSWORD_HASHERS = ["tests.harness.passwords.FewRoundsPBKDF2PasswordHasher"]
    _flush_again_after_a_deadlock()


# How many times a transactional test's flush is tried when PostgreSQL picks it as a deadlock's
# victim.
FLUSH_TRIES = 3


def _flush_again_after_a_deadlock() -> None:
    """A transactional test's flush truncates every table while the processes a module keeps
    across its tests (web processes writing usage rows and stamps) may be inside a transaction
    of their own: PostgreSQL can end either as a deadlock's victim (seen: the usage rows of a
    burst of 32 requests written as the test ended). Their transaction is theirs to retry (the
    product does); the flush is tried again here, the test's outcome untouched."""
    from django.core.management.base import CommandError
    from django.test import TransactionTestCase
    from psycopg.errors import DeadlockDetected

    flush = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]  # private in the stubs

    def deadlocked(error: BaseException | None) -> bool:
        while error is not None:
            if isinstance(error, DeadlockDetected):
                return True
            error = error.__cause__ or error.__context__
        return False

    def teardown(self: TransactionTestCase) -> None:
        for tried in range(1, FLUSH_TRIES + 1):
            try:
                flush(self)
                return
            except CommandError as error:
                if tried == FLUSH_TRIES or not deadlocked(error):
                    raise
                time.sleep(0.2 * tried)

    TransactionTestCase._fixture_teardown = teardown  # type: ignore[attr-defined]


def uses_store(item: pytest.Item) -> bool:
    """The test reaches the store under test: pytest-django's database (its marker or its
    fixtures), or a module-wide one (``store`` marker)."""
    return bool(
        item.get_closest_marker("django_db")
        or item.get_closest_marker("store")
        or STORE_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


# The modules that take longest (summed test time in a full run on a slow machine, longest
# first). The workers take modules in collection order; one of these taken last would end its
# pass alone on one core, so they go first. Only the order changes: every module still runs.
LONGEST_MODULES = (
    "tests/control/test_cluster_e2e.py",
    "tests/control/test_store_outage_e2e.py",
    "tests/agents/test_agent_e2e_grpc.py",
    "tests/agents/test_agent_e2e_websocket.py",
    "tests/gateway/test_limits_e2e.py",
    "tests/control/test_fleet_e2e.py",
    "tests/site/test_health_and_commands.py",
    "tests/gateway/test_accounting_e2e.py",
    "tests/control/test_redis_outage_e2e.py",
    "tests/site/test_three_edges.py",
    "tests/site/test_admin_api_schema.py",
    "tests/site/test_rolling_restart.py",
    "tests/site/test_agent_listeners_e2e.py",
    "tests/site/test_broker.py",
    "tests/site/test_browser.py",
    "tests/control/test_lease_pause_e2e.py",
    "tests/site/test_sqlite_writers_e2e.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(items)  # a stable sort: the rest keep their order
    if not config.getoption("store_tests_only"):
        return
    storeless = [item for item in items if not uses_store(item)]
    if storeless:
        config.hook.pytest_deselected(items=storeless)
        items[:] = [item for item in items if uses_store(item)]
    config.stash[STORELESS] = len(storeless)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if STORELESS in config.stash:
        terminalreporter.write_line(
            f"--store-tests-only: {config.stash[STORELESS]} tests that do not use the store "
            "were deselected (they ran in the first backend's pass)"
        )


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """One test database per pytest run, so runs side by side (two checkouts, a developer and
    an editor's test runner) never create or drop each other's database."""
    _set_suffix_to_test_databases(os.environ.get("LLMGW_TEST_DB_SUFFIX") or f"p{os.getpid()}")
    # An SQLite store's folder (the Makefile's var/) exists on a fresh checkout only once
    # something has run there: the tests keep their own var folder elsewhere (process_dirs).
    if connection.vendor == "sqlite":
        name = str(connection.settings_dict["TEST"]["NAME"] or connection.settings_dict["NAME"])
        if not name.startswith("file:") and name != ":memory:":
            Path(name).parent.mkdir(mode=0o700, parents=True, exist_ok=True)


@pytest.fixture(scope="session")
def django_db_setup(
    request: pytest.FixtureRequest,
    django_test_environment: None,
    django_db_blocker: DjangoDbBlocker,
    django_db_modify_db_settings: None,
) -> Iterator[None]:
    """The test database, migrated, for the whole run. pytest-django's own fixture creates it
    only for tests marked for its per-test database; a module that shares one cluster across
    its tests (``store`` marker, ``tests.harness.store.module_store``) needs it as well."""
    from django.test.utils import setup_databases, teardown_databases

    verbosity = request.config.option.verbose
    with django_db_blocker.unblock():
        # (django-stubs types ``aliases`` as a mapping; Django takes any collection of names.)
        created = setup_databases(
            verbosity=verbosity,
            interactive=False,
            aliases={"default"},  # type: ignore[arg-type]
        )
    yield
    with django_db_blocker.unblock():
        _let_other_sessions_leave()
        teardown_databases(created, verbosity=verbosity)


def _let_other_sessions_leave(timeout: float = 10.0) -> None:
    """PostgreSQL refuses to drop a database while anyone is connected. The processes the last
    module stopped (web, worker, agents) may still be closing their sessions: wait for them.
    What stays is ended, as ``DROP DATABASE ... WITH (FORCE)`` would, and named on stderr: a
    thread of this process that kept its connection (``sync_to_async``'s executor keeps one
    for the life of the process) or a process a test failed to stop."""
    if connection.vendor != "postgresql":
        return
    others = "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while True:
            cursor.execute(f"SELECT client_port, application_name, state, query {others}")
            stayed = cursor.fetchall()
            if not stayed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if stayed:
            own = own_tcp_ports()
            for port, application, state, query in stayed:
                whose = "this test process" if port in own else "another process"
                print(
                    f"\nending a session on the test database ({whose}, port {port},"
                    f" {application or 'no name'}, {state}): {query[:120]!r}",
                    file=sys.stderr,
                )
            cursor.execute(f"SELECT pg_terminate_backend(pid) {others}")
    connection.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private Redis for tests that only need one (never 127.0.0.1:6379: someone else's).
    A test that stops or restarts Redis starts its own."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def election_on(settings: Any) -> Any:
    """Lease timings for tests that race for it (every control plane competes, always)."""
    settings.LLMGW_LEASE_TTL = 10.0
    settings.LLMGW_LEASE_RENEW_DEADLINE = 6.0
    return settings


@pytest.fixture
def store_unreachable() -> Iterator[None]:
    """Point the default connection at a store that cannot be reached, for real (for the
    whole test: ``tests.harness.store.unreachable_store`` is the same for a block)."""
    with unreachable_store():
        yield
