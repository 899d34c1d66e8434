"""``make bench-fleet``: the control plane at fleet scale, measured.

A thousand simulated nodes (``python -m agents.fleet``: the real agent, engines in-process)
against PostgreSQL and Redis, two web processes and one worker (with beat), as two
control-plane hosts: ``cp1`` (web and the reconciler's worker, so the leader) and ``cp2`` (web
only). Each node lists both; half start with each. The catalog is mixed: single-GPU, multi-GPU
and two-node models, ``min_replicas`` 0 to 2. Phases, in order:

1. the fleet connects to an empty catalog; the catalog is written; time until every replica
   its minimums ask for is placed, then ready;
2. steady state: reconcile tick p50/p99 (each tick's runtime from the worker's Celery task
   events), heartbeat and other writes per second at the store (``pg_stat_user_tables``);
3. a wave: requests for ``--wave`` cold models recorded at once (demand, as the gateway
   records it); tick p50/p99 until all are ready;
4. ``--duration`` seconds of steady state: web-process RSS sampled, and its slope; database
   connections each web process holds (``pg_stat_activity`` by application name);
5. a reconnect storm: cp1's web process and worker are killed (SIGKILL); time until every
   node is connected to cp2 and has been sent its desired state, handshakes refused meanwhile,
   and the ERROR/FATAL lines PostgreSQL logged for this database.

Invariants are checked throughout (the cluster tests' store checker: no GPU or port given to
two live shards, no model above its maximum; and the fleet's own: no GPU used by two live
engines of one node). The table is printed, and written as JSON to ``--json`` (default
``var/bench-fleet.json``).

    python -m bench.fleet [--nodes 1000] [--models 500] [--duration 600]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import rss_mib

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "var" / "bench-fleet"
PG_LOG = Path("/var/log/postgresql/postgresql-15-main.log")
GOALS = {
    "tick_p99_s": 1.0,
    "tick_p50_s": 0.25,
    "storm_s": 30.0,
    "placement_s": 60.0,
}


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


# --------------------------------------------------------------------------- the catalog


def catalog_shapes(count: int) -> list[dict[str, Any]]:
    """``count`` models of mixed shapes, deterministic: 60% one GPU, 20% two, 10% four,
    5% eight, 5% two nodes of eight GPUs; min replicas 0 (45%), 1 (35%) or 2 (20%)."""
    shapes = []
    for i in range(count):
        size = i % 20
        if size < 12:
            gpus, shards = 1, 1
        elif size < 16:
            gpus, shards = 2, 1
        elif size < 18:
            gpus, shards = 4, 1
        elif size < 19:
            gpus, shards = 8, 1
        else:
            gpus, shards = 8, 2
        slot = (i * 7) % 20
        minimum = 0 if slot < 9 else (1 if slot < 16 else 2)
        shapes.append(
            {
                "name": f"m{i:03d}-{gpus * shards}g",
                "gpus": gpus,
                "shards": shards,
                "min": minimum,
                "max": max(1, minimum + 1),
            }
        )
    return shapes


def write_catalog(shapes: list[dict[str, Any]]) -> None:
    from control.models import Profile, ServedModel

    profiles = {}
    for gpus, shards in sorted({(s["gpus"], s["shards"]) for s in shapes}):
        profiles[(gpus, shards)] = Profile.objects.create(
            name=f"sim-{gpus}x{shards}",
            engine="sim",
            gpus_per_shard=gpus,
            shards_per_replica=shards,
            startup_timeout_s=120,
        )
    for shape in shapes:
        profile = profiles[(shape["gpus"], shape["shards"])]
        model = ServedModel.objects.create(
            name=shape["name"],
            source=f"bench/{shape['name']}",
            default_profile=profile,
            min_replicas=shape["min"],
            max_replicas=shape["max"],
            idle_timeout_s=24 * 3600,  # no scale-down while measuring
            activation_timeout_s=600,
        )
        model.profiles.add(profile)


# --------------------------------------------------------------------------- the store


def fresh_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"database name {name!r}: use lowercase letters, digits, _")
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name}")


def sql(query: str, *params: Any) -> list[tuple[Any, ...]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return list(cursor.fetchall())


def connections_by_app() -> dict[str, int]:
    rows = sql(
        "SELECT application_name, count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() GROUP BY application_name"
    )
    return {str(name): int(n) for name, n in rows}


def table_writes() -> dict[str, int]:
    rows = sql(
        "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables "
        "WHERE relname LIKE 'control_%%'"
    )
    return {str(name): int(n) for name, n in rows}


def node_heartbeat_writes() -> int:
    return int(
        sql("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'control_node'")[0][0]
    )


def committed() -> tuple[int, int]:
    """(transactions committed, sessions opened) in this database so far."""
    row = sql(
        "SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = current_database()"
    )[0]
    return int(row[0]), int(row[1])


def wanted_replicas() -> int:
    from control.models import ServedModel

    return sum(ServedModel.objects.values_list("min_replicas", flat=True))


def replica_counts() -> tuple[int, int]:
    """(running replicas placed, of them ready)."""
    from control.models import Replica

    running = Replica.objects.filter(desired=Replica.Desired.RUNNING)
    return running.count(), running.filter(observed=Replica.Observed.READY).count()


def store_errors(since: int, database: str) -> list[str]:
    """ERROR/FATAL/PANIC lines PostgreSQL logged about ``database`` after byte ``since``."""
    try:
        with PG_LOG.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except OSError:
        return ["(the PostgreSQL log is not readable here)"]
    return [
        line
        for line in text.splitlines()
        if re.search(r"\b(ERROR|FATAL|PANIC):", line) and f"@{database} " in line
    ]


def log_size() -> int:
    try:
        return PG_LOG.stat().st_size
    except OSError:
        return 0


# --------------------------------------------------------------------------- processes


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per hour."""
    if len(samples) < 2:
        return 0.0
    xs = [t for t, _ in samples]
    ys = [v for _, v in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mean_x) ** 2 for x in xs)
    if den == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / den * 3600


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


def wait(what: str, predicate: Callable[[], bool], timeout: float, rig: Rig) -> float:
    """Poll ``predicate`` until true; seconds it took. Fails naming ``what`` and the logs."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            tails = "\n".join(
                f"--- {p.name}\n{p.tail(15)}"
                for p in (rig.web1, rig.web2, rig.worker, rig.fleet)
                if p is not None
            )
            raise TimeoutError(f"{what}: not within {timeout:g}s\n{tails}")
        for proc in (rig.web2, rig.fleet):
            if proc is not None and not proc.running():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail(30)}")
        time.sleep(0.2)
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


# --------------------------------------------------------------------------- phases


def run(options: Options, say: Callable[[str], None] = print) -> dict[str, Any]:
    from django.utils import timezone

    from control.models import Node, ServedModel

    if options.create_database:
        fresh_database(options.database_url)
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
    report: dict[str, Any] = {"options": {**options.__dict__, "work": str(options.work)}}
    report["options"].pop("settings", None)
    shapes = catalog_shapes(options.models)
    database = options.database_url.rsplit("/", 1)[1]
    with started(options) as rig:
        n = options.nodes
        checker = StoreChecker()
        checker.start()
        try:
            # 1. every node connected, then the catalog from empty
            took = wait(
                "every node connected",
                lambda: (
                    rig.fleet_stats().get("served", 0) >= n
                    and Node.objects.filter(health=Node.Health.READY).count() >= n
                ),
                300,
                rig,
            )
            say(f"{n} nodes connected in {took:.1f}s")
            write_catalog(shapes)
            catalog_at = time.time()
            wanted = wanted_replicas()
            placed_s = wait("the catalog placed", lambda: replica_counts()[0] >= wanted, 600, rig)
            ready_s = (
                wait("the catalog ready", lambda: replica_counts()[1] >= wanted, 600, rig)
                + placed_s
            )
            report["placement"] = {
                "replicas": wanted,
                "gpus": sum(s["gpus"] * s["shards"] * s["min"] for s in shapes),
                "placed_s": round(placed_s, 2),
                "ready_s": round(ready_s, 2),
                "ticks": len(rig.tick_runtimes(catalog_at)[0]),
            }
            say(f"catalog: {wanted} replicas placed in {placed_s:.1f}s, ready in {ready_s:.1f}s")

            # 2. steady state
            steady_from = time.time()
            writes0, beats0, commits0 = table_writes(), node_heartbeat_writes(), committed()
            time.sleep(options.steady)
            elapsed = time.time() - steady_from
            writes1, beats1, commits1 = table_writes(), node_heartbeat_writes(), committed()
            ticks, failed = rig.tick_runtimes(steady_from)
            report["steady"] = {
                "seconds": round(elapsed, 1),
                "ticks": len(ticks),
                "ticks_failed": failed,
                "tick_p50_s": round(percentile(ticks, 0.5), 4),
                "tick_p99_s": round(percentile(ticks, 0.99), 4),
                "node_row_writes_per_s": round((beats1 - beats0) / elapsed, 1),
                "row_writes_per_s": {
                    k: round((writes1.get(k, 0) - v) / elapsed, 1)
                    for k, v in writes0.items()
                    if writes1.get(k, 0) != v
                },
                "commits_per_s": round((commits1[0] - commits0[0]) / elapsed, 1),
                "sessions_opened_per_s": round((commits1[1] - commits0[1]) / elapsed, 1),
            }
            say(f"steady: {json.dumps(report['steady'])}")

            # 3. a wave of activations
            cold = [s["name"] for s in shapes if s["min"] == 0][: options.wave]
            wave_from = time.time()
            now = timezone.now()
            ServedModel.objects.filter(name__in=cold).update(demand_at=now, last_request_at=now)
            from control import serving

            serving.request_tick()
            target = wanted + len(cold)
            wave_s = wait("the wave ready", lambda: replica_counts()[1] >= target, 600, rig)
            ticks, failed = rig.tick_runtimes(wave_from)
            report["wave"] = {
                "models": len(cold),
                "ready_s": round(wave_s, 2),
                "ticks": len(ticks),
                "ticks_failed": failed,
                "tick_p50_s": round(percentile(ticks, 0.5), 4),
                "tick_p99_s": round(percentile(ticks, 0.99), 4),
            }
            say(f"wave: {json.dumps(report['wave'])}")

            # 4. a long steady state: memory and connections
            rss: dict[str, list[tuple[float, float]]] = {k: [] for k in rig.web_pids()}
            conns: list[dict[str, int]] = []
            started_at = time.monotonic()
            while True:
                t = time.monotonic() - started_at
                for name, pid in rig.web_pids().items():
                    rss[name].append((t, rss_mib(pid)))
                conns.append(connections_by_app())
                if t >= options.duration:
                    break
                time.sleep(min(10.0, max(1.0, options.duration / 30)))
            web_conns = [
                sum(v for k, v in c.items() if k in ("llmgw-cp1", "llmgw-cp2")) for c in conns
            ]
            report["memory"] = {
                "seconds": round(time.monotonic() - started_at, 1),
                "rss_mib_start": {k: round(v[0][1], 1) for k, v in rss.items()},
                "rss_mib_end": {k: round(v[-1][1], 1) for k, v in rss.items()},
                "rss_slope_mib_per_h": {k: round(slope_per_hour(v), 1) for k, v in rss.items()},
            }
            report["connections"] = {
                "web_max": max(web_conns),
                "by_process_last": conns[-1],
                "by_process_max": {k: max(c.get(k, 0) for c in conns) for k in set().union(*conns)},
            }
            say(f"memory: {json.dumps(report['memory'])}")
            say(f"connections: {json.dumps(report['connections'])}")

            # 5. the reconnect storm
            before = rig.fleet_stats()
            log_from = log_size()
            killed_url = rig.web1.url
            rig.web1.kill()
            rig.worker.kill()
            rig.beat.kill()
            storm_s = wait(
                "every node back and served",
                lambda: (
                    (s := rig.fleet_stats()).get("served", 0) >= n
                    and s.get("connected", 0) >= n
                    and not any(
                        killed_url.replace("http", "ws") in url
                        for url in s.get("connected_by_url", {})
                    )
                ),
                300,
                rig,
            )
            time.sleep(1)
            after = rig.fleet_stats()
            report["storm"] = {
                "seconds": round(storm_s, 2),
                "refused": after.get("refused", 0) - before.get("refused", 0),
                "reconnections": after.get("connections", 0) - before.get("connections", 0),
                "store_errors": store_errors(log_from, database)[:20],
                "web_connections_after": connections_by_app(),
            }
            say(f"storm: {json.dumps(report['storm'])}")
        finally:
            checker.stop()
            final = rig.fleet_stats()
            report["invariants"] = {
                "store_checks": checker.checks,
                "store_violations": checker.violations[:20],
                "fleet_gpu_conflicts": final.get("gpu_conflicts", []),
                "fleet_stale_rejected": final.get("stale_rejected", 0),
            }
    return report


# --------------------------------------------------------------------------- the table


def summarize(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    steady, wave = report.get("steady", {}), report.get("wave", {})
    if steady:
        rows.append(
            (
                "reconcile tick, steady, p50 / p99",
                f"{steady['tick_p50_s'] * 1000:.0f} / {steady['tick_p99_s'] * 1000:.0f} ms",
                "< 250 / < 1000 ms",
                steady["tick_p50_s"] < GOALS["tick_p50_s"]
                and steady["tick_p99_s"] < GOALS["tick_p99_s"],
            )
        )
        rows.append(
            (
                "heartbeat (node row) writes at the store",
                f"{steady['node_row_writes_per_s']:.1f}/s",
                "",
                None,
            )
        )
        rows.append(("commits at the store", f"{steady['commits_per_s']:.1f}/s", "", None))
        rows.append(
            (
                "connections opened at the store",
                f"{steady['sessions_opened_per_s']:.1f}/s",
                "",
                None,
            )
        )
    if wave:
        rows.append(
            (
                f"reconcile tick, wave of {wave['models']}, p50 / p99",
                f"{wave['tick_p50_s'] * 1000:.0f} / {wave['tick_p99_s'] * 1000:.0f} ms",
                "< 250 / < 1000 ms",
                wave["tick_p50_s"] < GOALS["tick_p50_s"]
                and wave["tick_p99_s"] < GOALS["tick_p99_s"],
            )
        )
        rows.append(
            (f"wave of {wave['models']} activations ready", f"{wave['ready_s']:.1f} s", "", None)
        )
    placement = report.get("placement")
    if placement:
        rows.append(
            (
                f"catalog from empty ({placement['replicas']} replicas) placed / ready",
                f"{placement['placed_s']:.1f} / {placement['ready_s']:.1f} s",
                "< 60 s",
                placement["ready_s"] < GOALS["placement_s"],
            )
        )
    conns = report.get("connections")
    if conns:
        rows.append(("DB connections held by web processes (max)", str(conns["web_max"]), "", None))
    memory = report.get("memory")
    if memory:
        slopes = ", ".join(f"{k} {v:+.1f}" for k, v in memory["rss_slope_mib_per_h"].items())
        ends = ", ".join(f"{k} {v:.0f}" for k, v in memory["rss_mib_end"].items())
        rows.append((f"web RSS after {memory['seconds']:.0f}s (MiB)", ends, "", None))
        rows.append(("web RSS slope (MiB/hour)", slopes, "flat", None))
    storm = report.get("storm")
    if storm:
        rows.append(
            (
                "reconnect storm: all back and served",
                f"{storm['seconds']:.1f} s, {storm['refused']} refused, "
                f"{len(storm['store_errors'])} store errors",
                "< 30 s, 0, 0",
                storm["seconds"] < GOALS["storm_s"]
                and storm["refused"] == 0
                and not storm["store_errors"],
            )
        )
    inv = report.get("invariants", {})
    bad = len(inv.get("store_violations", [])) + len(inv.get("fleet_gpu_conflicts", []))
    rows.append(("double allocations seen", str(bad), "0", bad == 0))
    return rows


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'figure':56} {'measured':40} {'goal':18} reached")
    for figure, measured, goal, ok in summarize(report):
        mark = "" if ok is None else ("yes" if ok else "NO")
        print(f"{figure:56} {measured:40} {goal:18} {mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--wave", type=int, default=200)
    parser.add_argument("--duration", type=float, default=600.0, help="steady seconds (RSS)")
    parser.add_argument("--steady", type=float, default=30.0, help="seconds of tick sampling")
    parser.add_argument("--ready-delay", type=float, default=2.0)
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_FLEET_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw_bench_fleet"
        ),
        help="a PostgreSQL database this run drops and creates",
    )
    parser.add_argument("--json", type=Path, default=REPO / "var" / "bench-fleet.json")
    args = parser.parse_args()
    options = Options(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        models=args.models,
        wave=args.wave,
        duration=args.duration,
        steady=args.steady,
        ready_delay=args.ready_delay,
        database_url=args.database_url,
    )
    os.environ.update(
        DATABASE_URL=options.database_url,
        SECRET_KEY=os.environ.get("SECRET_KEY") or "llmgw-bench-only",
        LLMGW_VAR_DIR=str(WORK),
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        LLMGW_LOG_LEVEL="WARNING",
    )
    WORK.mkdir(parents=True, exist_ok=True)
    import django

    django.setup()
    started_at = time.time()
    report = run(options, say=lambda text: print(text, flush=True))
    report["wall_s"] = round(time.time() - started_at, 1)
    report["summary"] = [
        {"figure": f, "measured": m, "goal": g, "reached": ok} for f, m, g, ok in summarize(report)
    ]
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
