"""A real llmgw cluster on loopback, for end-to-end tests of the control plane.

Control planes are each a daphne web process, a Celery worker and a Celery beat with a var
folder of their own (as separate hosts would have), sharing the test database and a private
``redis-server`` (broker and channel layer) this harness starts, so tests may restart it.
Agents are ``python -m agents`` with simulated GPUs; each has a port range of its own because
all of their engines share this one machine's loopback. An :class:`InvariantChecker` reads the
database and the live engine processes throughout and records every violation of the two
promises: no GPU given to two shards, no model above its replica count.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connection

from control import nodes
from control.models import Event, Node, Replica, ServedModel, Shard
from tests.harness.procs import REPO_ROOT, free_port
from tests.harness.store import child_env
from tests.harness.waits import wait_until

PYTHON = sys.executable
LIVE = {"starting", "ready", "draining"}

# Short intervals so that failures play out in seconds. The lease TTL bounds failover.
FAST = {
    "LLMGW_LEADER_ELECTION": "true",
    "LLMGW_LEASE_TTL": "3",
    "LLMGW_LEASE_RENEW_DEADLINE": "2",
    "LLMGW_RECONCILE_INTERVAL": "0.5",
    "LLMGW_UNREACHABLE_AFTER": "3",
    "LLMGW_LOST_AFTER": "6",
    "LLMGW_AGENT_HEARTBEAT_INTERVAL": "0.5",
    "LLMGW_AGENT_RESYNC_INTERVAL": "2",
    "LLMGW_BACKOFF_BASE": "0.5",
    "LLMGW_BACKOFF_MAX": "2",
    "LLMGW_DRAIN_TIMEOUT": "3",
    "LLMGW_LOG_LEVEL": "INFO",
    "LLMGW_DEBUG_LOGGERS": "control.reconciler",
}


@dataclass
class Service:
    """One process of the cluster, its output in a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a paused process cannot exit
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        return self.process.returncode

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class TcpProxy:
    """A loopback TCP forwarder that can cut every connection through it, for "this host lost
    the database, the others did not" (a partition of one process, not of the store)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.cut_off = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Reset every connection and refuse new ones until :meth:`restore`."""
        self.cut_off.set()
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )
                    sock.close()
                except OSError:
                    pass
            self.sockets.clear()

    def restore(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


@dataclass
class ControlPlane:
    name: str
    web: Service
    worker: Service
    beat: Service
    url: str
    proxy: TcpProxy | None = None

    def services(self) -> list[Service]:
        return [self.web, self.worker, self.beat]


@dataclass
class Agent:
    name: str
    service: Service
    port_range: tuple[int, int]


@dataclass
class Cluster:
    tmp: Path
    redis_port: int = 0
    redis: Service | None = None
    control_planes: list[ControlPlane] = field(default_factory=list)
    agents: dict[str, Agent] = field(default_factory=dict)
    next_engine_port: int = 24000

    # --- the broker --------------------------------------------------------------------

    def start_redis(self) -> None:
        if not self.redis_port:
            self.redis_port = free_port()
        argv = [
            "redis-server",
            "--port",
            str(self.redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.redis = Service("redis", argv, dict(os.environ), self.tmp / "redis.log").start()
        wait_until(self._redis_answers, 10, "redis to answer")

    def _redis_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    # --- control planes ----------------------------------------------------------------

    def add_control_plane(self, *, via_proxy: bool = False, **settings: str) -> ControlPlane:
        name = f"cp{len(self.control_planes) + 1}"
        var = self.tmp / name
        var.mkdir(parents=True, exist_ok=True)
        env = child_env(REDIS_URL=self.redis_url, LLMGW_VAR_DIR=str(var), **{**FAST, **settings})
        proxy = None
        if via_proxy and connection.vendor == "postgresql":
            proxy = TcpProxy(int(connection.settings_dict.get("PORT") or 5432))
            env["DATABASE_URL"] = re.sub(r":\d+/", f":{proxy.port}/", env["DATABASE_URL"])
        port = free_port()
        web = Service(
            f"{name}-web",
            [
                PYTHON,
                "-m",
                "daphne",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "llmgw_site.asgi:application",
            ],
            env,
            var / "web.log",
        )
        worker = Service(
            f"{name}-worker",
            [
                PYTHON,
                "-m",
                "celery",
                "-A",
                "llmgw_site",
                "worker",
                "--pool",
                "solo",
                "-n",
                f"{name}@%h",
                "--loglevel",
                "info",
            ],
            env,
            var / "worker.log",
        )
        beat = Service(
            f"{name}-beat",
            [
                PYTHON,
                "-m",
                "celery",
                "-A",
                "llmgw_site",
                "beat",
                "--schedule",
                str(var / "beat-schedule"),
                "--loglevel",
                "warning",
            ],
            env,
            var / "beat.log",
        )
        plane = ControlPlane(name, web, worker, beat, f"http://127.0.0.1:{port}", proxy)
        for service in plane.services():
            service.start()
        self.control_planes.append(plane)
        return plane

    # --- agents ------------------------------------------------------------------------

    def add_agent(self, name: str, gpus: str = "2x80GiB") -> Agent:
        token_file = self.tmp / "agents" / name / "token"
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text(nodes.issue_node_token(name) + "\n")
        low = self.next_engine_port
        self.next_engine_port += 50
        argv = [PYTHON, "-m", "agents", "--node", name, "--token-file", str(token_file)]
        for plane in self.control_planes:
            argv += ["--control-plane", plane.url]
        argv += [
            "--simulate-gpus",
            gpus,
            "--port-range",
            f"{low}-{low + 49}",
            "--advertise-address",
            "127.0.0.1",
            "--engine-host",
            "127.0.0.1",
            "--state-dir",
            str(token_file.parent / "state"),
            "--weights-dir",
            str(token_file.parent / "weights"),
            "--backoff-base",
            "0.2",
            "--backoff-max",
            "1",
            "--stop-grace",
            "3",
        ]
        env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "SECRET_KEY"}}
        service = Service(f"agent-{name}", argv, env, token_file.parent / "agent.log").start()
        agent = Agent(name, service, (low, low + 49))
        self.agents[name] = agent
        return agent

    def restart_agent(self, name: str) -> Agent:
        agent = self.agents[name]
        agent.service.start()
        return agent

    def node_of_port(self, port: int) -> str | None:
        for agent in self.agents.values():
            if agent.port_range[0] <= port <= agent.port_range[1]:
                return agent.name
        return None

    # --- the whole -----------------------------------------------------------------------

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.service.stop()
        for plane in self.control_planes:
            for service in plane.services():
                service.stop()
            if plane.proxy is not None:
                plane.proxy.close()
        for pid, _ in engine_processes():
            if self.node_of_port(_port_of(pid) or 0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.redis is not None:
            self.redis.stop()

    def logs(self) -> str:
        parts = []
        for plane in self.control_planes:
            for service in plane.services():
                parts.append(f"===== {service.name}\n{service.output()[-6000:]}")
        for agent in self.agents.values():
            parts.append(f"===== {agent.service.name}\n{agent.service.output()[-4000:]}")
        return "\n".join(parts)


# --- leadership, as the database shows it --------------------------------------------------


def leader_worker(cluster: Cluster) -> ControlPlane | None:
    """The control plane whose worker holds the lease (owner ids embed the pid)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT owner FROM control_lease WHERE name = 'reconciler'")
        row = cursor.fetchone()
    if not row or not row[0]:
        return None
    pid = row[0].split(":")[1]
    return next((p for p in cluster.control_planes if str(p.worker.pid) == pid), None)


def lease_state() -> tuple[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT owner, epoch FROM control_lease WHERE name = 'reconciler' "
            "AND expires_at_ms > llmgw_clock_ms()"
        )
        row = cursor.fetchone()
    return (str(row[0]), int(row[1])) if row else ("", 0)


def writes_by_epoch_in_commit_order() -> list[int]:
    """The epoch of every reconciler write (events) in the order they were committed."""
    return list(
        Event.objects.filter(kind__in=["placement", "lifecycle"], epoch__gt=0)
        .order_by("id")
        .values_list("epoch", flat=True)
    )


# --- engines as the operating system sees them ---------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _port_of(pid: int) -> int | None:
    argv = _cmdline(pid)
    if "--port" in argv:
        try:
            return int(argv[argv.index("--port") + 1])
        except (ValueError, IndexError):
            return None
    return None


def engine_processes() -> Iterator[tuple[int, dict[str, str]]]:
    """Live ``agents.sim`` engines started by an agent (they carry LLMGW_SHARD_ID)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if "agents.sim" not in _cmdline(pid):
            continue
        try:
            raw = (entry / "environ").read_bytes().decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if "State:\tZ" in status:
            continue
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if "LLMGW_SHARD_ID" in env:
            yield pid, env


class InvariantChecker:
    """Reads the store and the live engines every ``interval`` seconds from its own thread
    and keeps every violation it sees."""

    def __init__(self, cluster: Cluster, interval: float = 0.2) -> None:
        self.cluster = cluster
        self.interval = interval
        self.violations: list[str] = []
        self.checks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @contextmanager
    def running(self) -> Iterator[InvariantChecker]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.check_once()
                except Exception as exc:  # the store may be down on purpose
                    connection.close()
                    if "connect" not in str(exc).lower():
                        self.violations.append(f"checker error: {exc!r}")
                self._stop.wait(self.interval)
        finally:
            connection.close()

    def check_once(self) -> None:
        self.checks += 1
        holders: dict[tuple[int, int], list[int]] = defaultdict(list)
        ports: dict[tuple[int, int], list[int]] = defaultdict(list)
        for shard_id, node_id, gpus, port, desired, observed in Shard.objects.values_list(
            "pk", "node_id", "gpu_indices", "port", "replica__desired", "observed"
        ):
            if desired == Replica.Desired.STOPPED and observed not in LIVE:
                continue
            for gpu in gpus:
                holders[(node_id, int(gpu))].append(shard_id)
            ports[(node_id, port)].append(shard_id)
        for (node_id, gpu), shards in holders.items():
            if len(shards) > 1:
                self.violations.append(f"store: node {node_id} gpu {gpu} given to shards {shards}")
        for (node_id, port), shards in ports.items():
            if len(shards) > 1:
                self.violations.append(f"store: node {node_id} port {port} given to {shards}")
        running = Counter(
            Replica.objects.filter(desired=Replica.Desired.RUNNING).values_list(
                "model__name", flat=True
            )
        )
        for name, most in ServedModel.objects.values_list("name", "max_replicas"):
            if running[name] > most:
                self.violations.append(f"store: model {name} has {running[name]} > {most}")

        in_use: dict[tuple[str, str], list[int]] = defaultdict(list)
        for pid, env in engine_processes():
            node = self.cluster.node_of_port(_port_of(pid) or 0)
            if node is None:
                continue
            for gpu in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
                if gpu:
                    in_use[(node, gpu)].append(pid)
        for (node, gpu), pids in in_use.items():
            if len(pids) > 1:
                self.violations.append(f"engines: {node} gpu {gpu} used by pids {pids}")


def ready_replicas(model: str) -> int:
    return Replica.objects.filter(
        model__name=model, desired=Replica.Desired.RUNNING, observed=Replica.Observed.READY
    ).count()


def shard_nodes(model: str) -> set[str]:
    return set(
        Shard.objects.filter(
            replica__model__name=model, replica__desired=Replica.Desired.RUNNING
        ).values_list("node__name", flat=True)
    )


def node_health(name: str) -> str:
    return str(Node.objects.values_list("health", flat=True).get(name=name))


# --- ticks, as a worker's log shows them ------------------------------------------------------

_TICK = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*tick: leader epoch")


def tick_times(log: str) -> list[float]:
    """Wall-clock times (epoch seconds) of the ticks a worker ran as leader."""
    from datetime import datetime

    times = []
    for line in log.splitlines():
        match = _TICK.match(line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            times.append(stamp.timestamp())
    return times


@contextmanager
def table_locked(table: str, *then: str, mode: str = "ACCESS EXCLUSIVE") -> Iterator[None]:
    """Hold an ACCESS EXCLUSIVE lock on ``table`` (PostgreSQL) from a connection of its own:
    every tick that touches it waits, as a slow store would make it. Statements in ``then``
    run in the same transaction and commit with the release, so the waiting tick sees them."""
    import psycopg

    settings = connection.settings_dict
    with psycopg.connect(
        host=settings.get("HOST") or "127.0.0.1",
        port=int(settings.get("PORT") or 5432),
        user=settings.get("USER") or "postgres",
        dbname=settings["NAME"],
    ) as conn:
        conn.execute(f"LOCK TABLE {table} IN {mode} MODE")
        for statement in then:
            conn.execute(statement)
        yield
        conn.commit()


def execute_now(sql: str, params: tuple[Any, ...] = ()) -> Any:
    """Run one statement on a connection of its own, committed at once (while the test's own
    connection may be waiting on a lock)."""
    import psycopg

    settings = connection.settings_dict
    with psycopg.connect(
        host=settings.get("HOST") or "127.0.0.1",
        port=int(settings.get("PORT") or 5432),
        user=settings.get("USER") or "postgres",
        dbname=settings["NAME"],
        autocommit=True,
    ) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchone() if cursor.description else None


def steal_lease(owner: str = "thief:0:0", ttl_ms: int = 60_000) -> int:
    """Another owner takes the lease now (as after an expiry); returns the new epoch."""
    row = execute_now(
        "UPDATE control_lease SET owner = %s, epoch = epoch + 1, "
        "expires_at_ms = llmgw_clock_ms() + %s WHERE name = 'reconciler' RETURNING epoch",
        (owner, ttl_ms),
    )
    assert row is not None
    return int(row[0])


def release_stolen_lease(owner: str = "thief:0:0") -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE control_lease SET owner = '', expires_at_ms = 0 WHERE owner = %s", [owner]
        )
