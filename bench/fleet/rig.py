"""The fleet benchmark's run: its options, and its processes (Redis, two control planes, the
fleet of simulated nodes) started and stopped together, with the store's invariants checked
while they run."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "var" / "bench-fleet"


@dataclass(frozen=True)
class Options:
    nodes: int = 1000
    gpus_per_node: int = 8
    models: int = 500
    wave: int = 200
    duration: float = 600.0
    steady: float = 30.0
    ready_delay: float = 2.0
    database_url: str = "postgres://postgres@127.0.0.1:5432/llmgw_bench_fleet"
    # Where the store is made: a fresh database (the benchmark), or one that exists (a test).
    create_database: bool = True
    work: Path = WORK
    settings: dict[str, str] = field(default_factory=dict)


@dataclass
class Rig:
    """The processes of one run, and how to read the fleet's own report."""

    options: Options
    env: dict[str, str]
    web1: Any = None
    web2: Any = None
    worker: Any = None
    beat: Any = None
    fleet: Any = None
    redis: Any = None
    events: Any = None
    stats_path: Path = Path()

    def fleet_stats(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.stats_path.read_text()))
        except (OSError, ValueError):
            return {}

    def web_pids(self) -> dict[str, int]:
        return {"web1": self.web1.pid, "web2": self.web2.pid}

    def tick_runtimes(self, after: float, before: float = float("inf")) -> tuple[list[float], int]:
        """Runtimes of ticks that succeeded in (after, before], and how many failed."""
        done = [
            float(e["runtime"])
            for e in self.events.of("succeeded")
            if after < e.get("timestamp", 0) <= before and "runtime" in e
        ]
        failed = [e for e in self.events.of("failed") if after < e.get("timestamp", 0) <= before]
        return done, len(failed)

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> float:
        """Until ``predicate`` holds; the seconds it took. Fails naming ``what``, with the
        logs, at the deadline or as soon as cp2's web process or the fleet exits (cp1's are
        killed on purpose in the storm)."""
        started = time.monotonic()
        wait_until(
            predicate,
            timeout,
            what,
            interval=0.2,
            logs=[p for p in (self.web1, self.web2, self.worker, self.fleet) if p is not None],
            running=[p for p in (self.web2, self.fleet) if p is not None],
        )
        return time.monotonic() - started


class StoreChecker(threading.Thread):
    """The cluster tests' store invariants, checked every ``interval`` seconds."""

    def __init__(self, interval: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.violations: list[str] = []
        self.checks = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        from django.db import connection

        from tests.harness.cluster import store_violations

        try:
            while not self._stop_event.is_set():
                try:
                    self.violations += store_violations()
                    self.checks += 1
                except Exception as exc:
                    connection.close()
                    self.violations.append(f"checker error: {exc!r}")
                self._stop_event.wait(self.interval)
        finally:
            connection.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


@contextmanager
def started(options: Options) -> Iterator[Rig]:
    """Store, Redis, two control planes, the fleet (not yet connected to any catalog)."""
    from control import node_tokens
    from llmgw_site.management.commands.run import celery_argv
    from tests.harness.cluster import TaskEvents
    from tests.harness.procs import PYTHON, Proc, web_process
    from tests.harness.redis import RedisServer

    work = options.work
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        redis = RedisServer(work / "redis").start()
        stack.callback(redis.stop)
        env = dict(os.environ)
        env.update(
            DATABASE_URL=options.database_url,
            REDIS_URL=redis.url,
            SECRET_KEY=env.get("SECRET_KEY") or "llmgw-bench-only",
            LLMGW_PORT_RANGE="20000-20999",
            LLMGW_LOG_LEVEL="WARNING",
            **options.settings,
        )
        rig = Rig(options, env, redis=redis, stats_path=work / "fleet.json")
        procs: list[Any] = []

        def stop_all() -> None:
            for proc in reversed(procs):
                proc.stop(60)

        stack.callback(stop_all)
        planes = {}
        for name in ("cp1", "cp2"):
            var = work / name
            var.mkdir(exist_ok=True)
            planes[name] = {**env, "LLMGW_VAR_DIR": str(var), "PGAPPNAME": f"llmgw-{name}"}
        rig.web1 = web_process("cp1-web", work / "logs", planes["cp1"])
        procs.append(rig.web1)
        rig.web2 = web_process("cp2-web", work / "logs", planes["cp2"])
        procs.append(rig.web2)
        worker_env = {**planes["cp1"], "PGAPPNAME": "llmgw-cp1-worker"}
        worker = celery_argv("worker", "--pool", "solo", "-n", "cp1@%h", "-E")
        rig.worker = Proc("cp1-worker", worker, work / "logs", worker_env).start()
        procs.append(rig.worker)
        beat = celery_argv("beat", "--schedule", str(work / "cp1" / "beat-schedule"))
        rig.beat = Proc("cp1-beat", beat, work / "logs", worker_env).start()
        procs.append(rig.beat)
        rig.events = TaskEvents(redis.url)
        stack.enter_context(rig.events.running())

        names = [f"fleet-{i:04d}" for i in range(options.nodes)]
        tokens = {name: node_tokens.issue_node_token(name) for name in names}
        tokens_path = work / "tokens.json"
        tokens_path.write_text(json.dumps(tokens))
        tokens_path.chmod(0o600)
        argv = [
            PYTHON, "-m", "agents.fleet",
            "--control-plane", rig.web1.url,
            "--control-plane", rig.web2.url,
            "--tokens", str(tokens_path),
            "--nodes", str(options.nodes),
            "--gpus-per-node", str(options.gpus_per_node),
            "--ready-delay", str(options.ready_delay),
            "--port-range", "20000-20999",
            "--state-dir", str(work / "nodes"),
            "--stats-file", str(rig.stats_path),
            "--ramp", str(min(10.0, options.nodes / 100)),
        ]  # fmt: skip
        agent_env = {k: v for k, v in env.items() if not k.startswith(("DATABASE_", "LLMGW_"))}
        rig.fleet = Proc("fleet", argv, work / "logs", agent_env).start()
        procs.append(rig.fleet)
        yield rig
