"""The control plane's figures for ``make bench``, each on a fresh embedded store (SQLite) with
the processes ``manage.py run`` starts, and the default intervals (lease TTL, tick):

- cold start: a request for a model with no replica, whose engine takes ``STARTUP_DELAY`` to
  start: time to its first token, minus that delay (what llmgw adds: placement, the agent
  starting the engine, health polls, routing);
- failover: a second control plane (worker and beat) beside ``manage.py run``'s, both
  competing for the lease; the leader's worker is killed with SIGKILL and a request for a cold
  model is sent at once: time until another process holds the lease, and until the new
  leader's placement is written.

The store is read with ``sqlite3`` directly: this process is not one of llmgw's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.harness.procs import REPO_ROOT, Proc, free_port, port_window
from tests.harness.waits import wait_until

STARTUP_DELAY = 1.0

CATALOG = """
version: 1
profiles:
  - name: sim-slow-start
    engine: sim
    args: ["--startup-delay", "{delay}"]
  - name: sim
    engine: sim
models:
  - name: cold
    source: bench/cold
    default_profile: sim-slow-start
    profiles: [sim-slow-start]
    min_replicas: 0
    max_replicas: 1
    activation_timeout_s: 120
  - name: zero
    source: bench/zero
    default_profile: sim
    profiles: [sim]
    min_replicas: 0
    max_replicas: 1
    activation_timeout_s: 120
"""


def _store(var: Path) -> Path:
    return var / "store.sqlite3"


def _query(var: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(_store(var), timeout=30) as db:
        return db.execute(sql).fetchall()


@contextmanager
def make_run(var: Path, **settings: str) -> Iterator[tuple[Proc, str, str]]:
    """``manage.py run`` on a fresh store holding the benchmark's catalog, until its local
    agent is connected: (the process, its base URL, its demo key)."""
    var.mkdir(parents=True)
    env = dict(os.environ)
    env.update(
        DATABASE_URL=f"sqlite:///{_store(var)}",
        LLMGW_VAR_DIR=str(var),
        LLMGW_WEB_PROCESSES="1",
        LLMGW_PORT_RANGE="{}-{}".format(*port_window()),
        LLMGW_LOG_LEVEL="WARNING",
        **settings,
    )
    env.pop("REDIS_URL", None)
    manage = [sys.executable, str(REPO_ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v0"], env=env, check=True, cwd=REPO_ROOT)
    subprocess.run(
        [*manage, "import_catalog", "-"],
        input=CATALOG.replace("{delay}", str(STARTUP_DELAY)),
        text=True,
        env=env,
        check=True,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
    )
    port = free_port()
    run = Proc("run", [*manage, "run", "--port", str(port)], var, env, port=port).start()
    try:
        banner = wait_until(
            lambda: "Ctrl-C stops everything" in (text := run.log()) and text,
            what="manage.py run's banner",
            logs=[run],
        )
        found = re.search(r"API key:\s+(\S+)", banner)
        assert found, banner
        wait_until(
            lambda: (
                _query(var, "SELECT health FROM control_node WHERE name = 'local'") == [("ready",)]
            ),
            what="the local agent",
            logs=[run],
        )
        yield run, run.url, found.group(1)
    finally:
        run.signal(signal.SIGINT)
        run.wait(120)


def first_token(base: str, key: str, model: str) -> float:
    """Seconds from sending a streamed request to its first token."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {") and b'"content":"tok' in line:
                return time.perf_counter() - started
    raise RuntimeError(f"no token from {model}")


def cold_start(work: Path, samples: int) -> dict[str, float | list[float]]:
    """First token of a cold model minus its engine's start-up, on ``samples`` fresh stores."""
    overheads = []
    for n in range(samples):
        with make_run(work / f"cold-{n}") as (_, base, key):
            overheads.append(first_token(base, key, "cold") - STARTUP_DELAY)
    return {"overhead_s": sorted(overheads)[len(overheads) // 2], "samples_s": overheads}


def failover(work: Path) -> dict[str, float]:
    """Kill the leader's worker; how long until another process leads, and places."""
    # The worker and beat as `manage.py run` starts them (a module that needs Django set up).
    from llmgw_site.management.commands.run import celery_argv

    var = work / "failover"
    with make_run(var) as (run, base, key):
        # A second control plane on the same store: its own worker, beat and broker folder.
        other = var / "cp2"
        other.mkdir()
        env = {**run.env, "LLMGW_VAR_DIR": str(other)}
        schedule = str(other / "beat-schedule")
        standby = [
            Proc("cp2-worker", celery_argv("worker", "--pool", "solo"), other, env).start(),
            Proc("cp2-beat", celery_argv("beat", "--schedule", schedule), other, env).start(),
        ]
        try:

            def lease() -> tuple[str, int] | None:
                rows = _query(var, "SELECT owner, epoch FROM control_lease")
                return (str(rows[0][0]), int(str(rows[0][1]))) if rows and rows[0][0] else None

            owner, epoch = wait_until(lease, what="a leader", logs=[run, *standby])
            answered: list[float] = []
            request = threading.Thread(
                target=lambda: answered.append(first_token(base, key, "zero")), daemon=True
            )
            killed_at = time.perf_counter()
            os.kill(int(owner.split(":")[1]), signal.SIGKILL)
            request.start()  # held until the new leader has placed the model and it is ready
            wait_until(
                lambda: (now := lease()) is not None and now[1] > epoch,
                what="a new leader",
                interval=0.01,
            )
            led_after = time.perf_counter() - killed_at
            request.join(300)
            placed = _query(
                var,
                "SELECT min(r.created_at) FROM control_replica r JOIN control_servedmodel m "
                "ON r.model_id = m.id WHERE m.name = 'zero'",
            )
            return {
                "new_leader_after_s": led_after,
                "placement_after_s": _after(killed_at, str(placed[0][0])),
                "first_token_after_s": answered[0],
            }
        finally:
            for proc in standby:
                proc.stop()


def _after(start_perf: float, stamp: str) -> float:
    """Seconds from ``start_perf`` (this process's perf counter) to a UTC store timestamp."""
    from datetime import UTC, datetime

    at = datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()
    return at - (time.time() - (time.perf_counter() - start_perf))
