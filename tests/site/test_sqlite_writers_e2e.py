"""[L14] SQLite with everything writing at once, end to end: the embedded default (``manage.py
run``: two web processes, the reconciler's worker and beat, the local agent; no Redis, so rate
limits and budgets count in the store too) on one SQLite file, plus an agent with eight
simulated GPUs, driven hard: a dozen clients on a key with limits (a usage row and counter
writes per request), models scaled up and down all the while (placements, stops, Events), the
lease renewed twice a second, heartbeats from both agents, and in the middle a writer from
outside holding SQLite's one write lock for twice the lease TTL (as a long admin transaction or
a script would).

What must hold, with the request path's waits for the store longer than the lock: no
``database is locked`` reaches anyone (every request is answered, no error
line, no traceback, no process restarted), a lock met by the lease's renew counts as "store
unreachable this round" (the same owner and epoch lead afterwards), every request has exactly
one usage row, and the fleet converges with no GPU given twice.
"""

from __future__ import annotations

import itertools
import re
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from django.db import connection

from control.models import ServedModel
from gateway.models import ApiKey, UsageRecord
from tests.harness.cluster import (
    Cluster,
    lease_state,
    node_health,
    ready_replicas,
    store_violations,
)
from tests.harness.factories import make_key, make_model
from tests.harness.procs import Proc, free_port, port_window
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(400)]

TTL = 3.0
SETTINGS = {
    "LLMGW_WEB_PROCESSES": "2",
    "LLMGW_LEASE_TTL": str(TTL),
    "LLMGW_LEASE_RENEW_DEADLINE": "2",
    "LLMGW_RECONCILE_INTERVAL": "0.5",
    "LLMGW_AGENT_HEARTBEAT_INTERVAL": "0.5",
    "LLMGW_AGENT_RESYNC_INTERVAL": "2",
    "LLMGW_USAGE_FLUSH_INTERVAL": "0.05",
    "LLMGW_ROUTING_REFRESH": "0.2",
    # The request path waits for the store at most LLMGW_STORE_WAIT, and trusts a key only
    # within its TTL: both outlast the lock held below, so that a request refused here could
    # only be the lock leaking through. (A lock held past them is an outage: requests that
    # need the store are answered 503 at once, tests/control/test_store_outage_e2e.py.) The
    # keys are still reloaded while the lock is held, every third of the TTL.
    "LLMGW_KEY_CACHE_TTL": str(5 * TTL),
    "LLMGW_STORE_WAIT": str(4 * TTL),
    "LLMGW_BACKOFF_BASE": "0.5",
    "LLMGW_BACKOFF_MAX": "2",
    "LLMGW_IDLE_LINGER": "0.5",
    "LLMGW_LOG_LEVEL": "INFO",
}
CLIENTS = 12
LOAD_SECONDS = 20.0
CHURN = ("churn-1", "churn-2", "churn-3")


@dataclass
class Embedded:
    run: Proc
    url: str
    agents: Cluster


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[Embedded]:
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one write lock is the subject; PostgreSQL has row locks")
    low, high = port_window()
    env = child_env(
        LLMGW_VAR_DIR=str(tmp_path / "var"), LLMGW_PORT_RANGE=f"{low}-{high}", **SETTINGS
    )
    env.pop("REDIS_URL", None)
    port = free_port()
    argv = [sys.executable, "manage.py", "run", "--port", str(port)]
    run = Proc("run", argv, tmp_path / "logs", env, port=port).start()
    agents = Cluster(tmp_path / "more")
    try:
        wait_until(lambda: "Ctrl-C stops everything" in run.log(), what="the banner", logs=[run])
        url = f"http://127.0.0.1:{port}"
        agents.add_agent("big", gpus="8x80GiB", urls=[url])
        yield Embedded(run, url, agents)
    finally:
        agents.stop()
        if run.running():
            run.signal(signal.SIGINT)
            run.wait(120)


@dataclass
class Load:
    """What the clients got, by outcome."""

    outcomes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1


def client_loop(url: str, key: str, until: float, load: Load) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        try:
            if n % 2:
                chunks = client.chat.completions.create(
                    model="hot", messages=[{"role": "user", "content": f"s{n}"}], stream=True
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                reply = client.chat.completions.create(
                    model="hot", messages=[{"role": "user", "content": f"n{n}"}]
                )
                text = reply.choices[0].message.content or ""
            load.count("answered" if text else "empty")
        except openai.APIStatusError as exc:
            load.count(f"{exc.status_code}: {exc.message[:80]}")
        except openai.APIError as exc:
            load.count(f"{type(exc).__name__}: {exc}"[:100])


def churn(until: float) -> None:
    """Scale the churn models between none and two replicas, one after another."""
    try:
        for n in itertools.count():
            if time.monotonic() >= until:
                return
            name = CHURN[n % len(CHURN)]
            wanted = 0 if ServedModel.objects.get(name=name).min_replicas else 2
            ServedModel.objects.filter(name=name).update(min_replicas=wanted)
            time.sleep(0.7)
    finally:
        connection.close()  # this thread's


def hold_the_write_lock(database: str, seconds: float) -> None:
    """SQLite's one write lock, held from outside for ``seconds``: every writer waits."""
    outside = sqlite3.connect(database, timeout=60, isolation_level=None)
    try:
        outside.execute("BEGIN IMMEDIATE")
        time.sleep(seconds)  # the fault itself
        outside.execute("ROLLBACK")
    finally:
        outside.close()


def errors_in(log: str) -> list[str]:
    """Lines of ``log`` that tell of a failure: error or critical level, a traceback, a lock."""
    pattern = re.compile(r" (ERROR|CRITICAL) |Traceback|database is locked|raised unexpected")
    return [line for line in log.splitlines() if pattern.search(line)]


def test_l14_sqlite_with_lease_usage_and_placement_writing_at_once_locks_nobody_out(
    embedded: Embedded, record_property: Callable[[str, object], None]
) -> None:
    """[L14] Twenty seconds of a dozen clients, placements and the lease on one SQLite file,
    with its write lock held from outside for twice the TTL meanwhile: every request answered
    and counted once, no error anywhere, one leader, the fleet converged."""
    key, api_key = make_key("busy", rpm=1_000_000, tpm=10**9, budget=10**12)
    make_model("hot", min_replicas=2, max_replicas=2, idle_timeout_s=3600)
    for name in CHURN:
        make_model(name, min_replicas=0, max_replicas=2, idle_timeout_s=3600)
    wait_until(lambda: node_health("big") == "ready", what="the big agent", logs=[embedded.run])
    wait_until(lambda: ready_replicas("hot") == 2, what="hot placed", logs=[embedded.run])
    owner, epoch = wait_until(lambda: lease_state()[0] and lease_state(), what="a leader")

    load = Load()
    until = time.monotonic() + LOAD_SECONDS
    threads = [
        threading.Thread(target=client_loop, args=(embedded.url, key, until, load))
        for _ in range(CLIENTS)
    ]
    threads.append(threading.Thread(target=churn, args=(until,)))
    for thread in threads:
        thread.start()
    try:
        time.sleep(LOAD_SECONDS / 3)  # the load first, then the lock in the middle of it
        hold_the_write_lock(str(connection.settings_dict["NAME"]), 2 * TTL)
    finally:
        for thread in threads:
            thread.join()

    answered = load.outcomes["answered"]
    record_property("requests_answered", answered)
    assert dict(load.outcomes) == {"answered": answered}, load.outcomes
    assert answered >= CLIENTS  # every client had answers: the load was real, whatever its pace
    wait_until(
        lambda: UsageRecord.objects.filter(api_key=api_key).count() >= answered,
        what=f"{answered} usage rows",
        logs=[embedded.run],
    )
    assert UsageRecord.objects.filter(api_key=api_key).count() == answered
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at is not None

    # The fleet converges from wherever the churn left it, and no GPU was given twice.
    for name in CHURN:
        ServedModel.objects.filter(name=name).update(min_replicas=1)
    wait_until(
        lambda: all(ready_replicas(name) == 1 for name in CHURN) and ready_replicas("hot") == 2,
        what="every model at its replica count",
        logs=[embedded.run],
    )
    assert store_violations() == []
    assert lease_state() == (owner, epoch), "the same leader, never deposed by a lock"

    embedded.run.signal(signal.SIGINT)
    assert embedded.run.wait(120) == 0
    log = embedded.run.log()
    assert errors_in(log) == [], errors_in(log)[:20]
    assert Counter(re.findall(r"started (\S+) \(pid", log)) == {
        "web-1": 1,
        "web-2": 1,
        "worker": 1,
        "beat": 1,
        "agent": 1,
    }, "no process restarted"
