"""A real llmgw cluster on loopback, for end-to-end tests of the control plane and the agents.

A control plane is a web process (started as ``manage.py run`` starts one) and, unless asked
otherwise, a Celery worker and beat, with a var folder of its own as a separate host would
have; all share the test database and a private ``redis-server`` (broker and channel layer)
this harness starts, so tests may stop and restart it. Agents are ``python -m agents`` with
simulated GPUs; each has a window of engine ports of its own, because all their engines share
this machine's loopback.

What the tests observe comes from the store, the processes and the wire: an
:class:`InvariantChecker` reads the store and the live engines throughout and records every
violation of the two promises (no GPU given to two shards, no model above its replica count);
:class:`TaskEvents` receives the workers' Celery task events, so a test knows when a tick ran
without reading a log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from django.db import connection

from agents.processes import process_start_ticks
from control import node_certs, node_tokens
from control.models import Event, Node, Replica, ServedModel, Shard
from llmgw_site.management.commands.run import celery_argv
from tests.harness.procs import (
    PORT_WINDOW,
    PYTHON,
    REPO_ROOT,
    Proc,
    engine_processes,
    free_port,
    port_window,
    web_process,
)
from tests.harness.proxy import TcpProxy
from tests.harness.redis import RedisServer
from tests.harness.store import child_env, execute_now, store_behind_proxy
from tests.harness.waits import wait_until

LIVE = {"starting", "ready", "draining"}

# Short intervals, so that failures play out in seconds. The lease TTL bounds failover.
FAST = {
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
    "LLMGW_IDLE_LINGER": "0.5",  # a stop does not wait out the test's idle client connections
}


WEBSOCKET = "websocket"
GRPC = "grpc"  # gRPC with mutual TLS: node certificates from the cluster's CA, no tokens


def grpc_listener(name: str, log_dir: Path, env: Mapping[str, str], port: int) -> Proc:
    """The agents' gRPC listener as ``manage.py run`` starts it (LLMGW_AGENT_LISTEN)."""
    argv = [PYTHON, str(REPO_ROOT / "manage.py"), "serve_agents_grpc"]
    argv += ["--listen", f"127.0.0.1:{port}"]
    return Proc(name, argv, log_dir, env, port=port).start().wait_listening()


def engine_home(pid: int) -> Path | None:
    """Where an engine runs from: its agent's state folder (agents.supervisor starts it there)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


@dataclass
class ControlPlane:
    """One control-plane host: its web process (and, over gRPC, its agent listener), and its
    reconciler worker and beat."""

    name: str
    var: Path
    env: dict[str, str]
    port: int
    web: Proc | None = None
    worker: Proc | None = None
    beat: Proc | None = None
    proxy: TcpProxy | None = None
    reconciler_proxy: TcpProxy | None = None  # the worker's and beat's own, when asked for
    transport: str = WEBSOCKET
    agent_port: int = 0  # the gRPC listener's; the web port for WebSocket
    grpc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def agent_url(self) -> str:
        """Where agents dial this control plane."""
        return agent_url(self.transport, self.agent_port)

    def services(self) -> list[Proc]:
        return [p for p in (self.web, self.grpc, self.worker, self.beat) if p is not None]

    def start_web(self, **env: str) -> Proc:
        """(Re)start the web process on this plane's port (and its gRPC agent listener), with
        ``env`` over its settings."""
        if self.web is not None:
            self.web.stop()
        self.web = web_process(
            f"{self.name}-web", self.var / "logs", {**self.env, **env}, port=self.port
        )
        if self.transport == GRPC:
            if self.grpc is not None:
                self.grpc.stop()
            self.grpc = grpc_listener(
                f"{self.name}-grpc", self.var / "logs", {**self.env, **env}, self.agent_port
            )
        return self.web

    def stop_web(self) -> None:
        for proc in (self.web, self.grpc):
            if proc is not None:
                proc.stop()


def agent_url(transport: str, port: int) -> str:
    return f"grpcs://127.0.0.1:{port}" if transport == GRPC else f"http://127.0.0.1:{port}"


@dataclass
class Agent:
    """One node's agent: where it keeps its token, state and weights, and its incarnations."""

    name: str
    home: Path
    ports: tuple[int, int]
    argv: list[str]
    env: dict[str, str]
    proc: Proc | None = None

    @property
    def token_file(self) -> Path:
        return self.home / "token"

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    @property
    def weights_dir(self) -> Path:
        return self.home / "weights"

    def start(self, *extra: str, urls: Sequence[str] = ()) -> Proc:
        """A new incarnation (its own log), optionally with other control-plane addresses."""
        argv = list(self.argv)
        if urls:
            argv = [a for i, a in enumerate(argv) if not _is_control_plane_arg(argv, i)]
            argv += [a for url in urls for a in ("--control-plane", url)]
        self.proc = Proc(f"agent-{self.name}", [*argv, *extra], self.home / "logs", self.env)
        return self.proc.start()

    def shard_pids(self) -> dict[int, int]:
        """Shard id → engine pid, from the agent's own record of what it runs."""
        try:
            data = json.loads((self.state_dir / "shards.json").read_text())
        except (OSError, ValueError):
            return {}
        return {
            int(s["spec"]["shard_id"]): int(s["pid"])
            for s in data.get("shards", [])
            if process_start_ticks(int(s["pid"])) == s["start"]  # still that very process
        }

    def engines(self) -> dict[int, list[int]]:
        """Shard id → pids of the live engines serving it on this node, as the OS sees them:
        in its port window and started in its state folder (the agent starts them there).
        Another run on this machine (the other database's pass) may draw the same window, and
        its shard ids count from 1 too."""
        found: dict[int, list[int]] = defaultdict(list)
        home = self.state_dir.resolve()
        for pid, env in engine_processes(self.ports):
            if engine_home(pid) == home:
                found[int(env["LLMGW_SHARD_ID"])].append(pid)
        return dict(found)

    def free_port(self) -> int:
        """A port in this agent's window that nothing listens on."""
        for port in random.sample(range(self.ports[0], self.ports[1] + 1), PORT_WINDOW):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise AssertionError(f"no free port in {self.ports}")


def _is_control_plane_arg(argv: list[str], i: int) -> bool:
    return argv[i] == "--control-plane" or (i > 0 and argv[i - 1] == "--control-plane")


@dataclass
class Cluster:
    root: Path
    settings: dict[str, str] = field(default_factory=lambda: dict(FAST))
    redis: RedisServer | None = None
    redis_proxy: TcpProxy | None = None  # between every process and Redis, when asked for
    control_planes: list[ControlPlane] = field(default_factory=list)
    agents: dict[str, Agent] = field(default_factory=dict)
    transport: str = WEBSOCKET

    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    def start_redis(self, *, via_proxy: bool = False) -> RedisServer:
        """The cluster's Redis; ``via_proxy`` puts a :class:`TcpProxy` between it and every
        process the cluster starts, so that a test can cut them off from it or slow it."""
        self.redis = RedisServer(self.root / "redis").start()
        if via_proxy:
            self.redis_proxy = TcpProxy(self.redis.port)
        return self.redis

    @property
    def redis_url(self) -> str:
        """Where the cluster's processes reach Redis (through its proxy, if it has one)."""
        assert self.redis is not None, "start_redis() first"
        if self.redis_proxy is None:
            return self.redis.url
        return f"redis://127.0.0.1:{self.redis_proxy.port}/0"

    # --- control planes ----------------------------------------------------------------

    def add_control_plane(
        self,
        *,
        reconciler: bool = True,
        via_proxy: bool = False,
        reconciler_via_proxy: bool = False,
        port: int = 0,
        agent_port: int = 0,
        **settings: str,
    ) -> ControlPlane:
        """A control plane on the test database; ``via_proxy`` routes its store connections
        through a :class:`TcpProxy` (PostgreSQL) so that the test can cut this host off, and
        ``reconciler_via_proxy`` those of its worker and beat through one of their own (the
        lease path alone). Over
        gRPC it also runs the agent listener (on ``agent_port``), with mutual TLS required."""
        assert self.redis is not None, "start_redis() first"
        name = f"cp{len(self.control_planes) + 1}"
        var = self.root / name
        var.mkdir(parents=True, exist_ok=True)
        if self.transport == GRPC:
            if not (self.ca_dir / node_certs.CA_CERT).exists():
                node_certs.init_ca(self.ca_dir, ["localhost", "127.0.0.1"])
            settings = {
                "LLMGW_CA_DIR": str(self.ca_dir),
                "LLMGW_AGENT_REQUIRE_IDENTITY": "true",
                **settings,
            }
        env = child_env(
            REDIS_URL=self.redis_url, LLMGW_VAR_DIR=str(var), **{**self.settings, **settings}
        )
        proxy = store_behind_proxy(env) if via_proxy else None
        plane = ControlPlane(name, var, env, port, proxy=proxy, transport=self.transport)
        self.control_planes.append(plane)
        plane.web = web_process(f"{name}-web", var / "logs", env, port=port)
        plane.port = plane.agent_port = plane.web.port
        if self.transport == GRPC:
            plane.agent_port = agent_port or free_port()
            plane.grpc = grpc_listener(f"{name}-grpc", var / "logs", env, plane.agent_port)
        if reconciler:
            env = dict(env)
            if reconciler_via_proxy:
                plane.reconciler_proxy = store_behind_proxy(env)
            # As ``manage.py run`` starts them, plus task events (-E) for TaskEvents.
            worker = celery_argv("worker", "--pool", "solo", "-n", f"{name}@%h", "-E")
            plane.worker = Proc(f"{name}-worker", worker, var / "logs", env).start()
            beat = celery_argv("beat", "--schedule", str(var / "beat-schedule"))
            plane.beat = Proc(f"{name}-beat", beat, var / "logs", env).start()
        return plane

    # --- agents ------------------------------------------------------------------------

    def add_agent(
        self,
        name: str,
        *extra: str,
        gpus: str = "2x80GiB",
        urls: Sequence[str] = (),
        program: Sequence[str] = (PYTHON, "-m", "agents"),
    ) -> Agent:
        """An agent for node ``name`` (its token issued now), connected to every control
        plane unless ``urls`` says otherwise; ``program`` is the agent's command (an installed
        ``llmgw-agent``, say)."""
        home = self.root / "agents" / name
        home.mkdir(parents=True, exist_ok=True)
        low, high = port_window({a.ports[0] for a in self.agents.values()})
        argv = [*program, "--node", name]
        for url in urls or [p.agent_url for p in self.control_planes]:
            argv += ["--control-plane", url]
        if self.transport == GRPC:
            argv += ["--transport", "grpc", "--tls-ca", str(home / "tls" / node_certs.CA_CERT)]
            argv += ["--tls-cert", str(home / "tls" / f"{name}.pem")]
            argv += ["--tls-key", str(home / "tls" / f"{name}.key")]
        if self.transport != GRPC:  # over gRPC the certificate is the identity
            argv += ["--token-file", str(home / "token")]
        argv += [
            "--simulate-gpus", gpus,
            "--port-range", f"{low}-{high}",
            "--advertise-address", "127.0.0.1",
            "--engine-host", "127.0.0.1",
            "--state-dir", str(home / "state"),
            "--weights-dir", str(home / "weights"),
            "--backoff-base", "0.2",
            "--backoff-max", "1",
            "--stop-grace", "3",
            # Generous: on a starved machine a pong can be seconds late, and a stream dropped for
            # that would fail the tests that prove streams survive (N10). No test relies on
            # the agent's pings to find a dead control plane.
            "--ping-timeout", "20",
        ]  # fmt: skip
        # An agent knows nothing of the store or of our settings.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_", "LLMGW_"))}
        env.pop("SECRET_KEY", None)
        agent = Agent(name, home, (low, high), argv, env)
        self.issue_credentials(agent)
        self.agents[name] = agent
        agent.start(*extra)
        return agent

    @staticmethod
    def issue_token(agent: Agent) -> str:
        """A fresh token in the agent's token file (the old one stops working)."""
        token = node_tokens.issue_node_token(agent.name)
        agent.token_file.write_text(token + "\n")
        agent.token_file.chmod(0o600)
        return token

    def issue_credentials(self, agent: Agent) -> None:
        """What this cluster's agents authenticate with: a token, or over gRPC a certificate
        (the agent reads either afresh before each connection attempt)."""
        if self.transport == GRPC:
            node_certs.issue_node_cert(agent.name, self.ca_dir, agent.home / "tls")
        else:
            self.issue_token(agent)

    def has_credentials(self, name: str) -> bool:
        field = "cert_serial" if self.transport == GRPC else "token_hash"
        return Node.objects.filter(name=name).exclude(**{field: ""}).exists()

    def node_of_engine(self, pid: int) -> str | None:
        """The node whose agent started engine ``pid``; None for another run's engine, even
        one in the same port window (see Agent.engines)."""
        home = engine_home(pid)
        for agent in self.agents.values():
            if home == agent.state_dir.resolve():
                return agent.name
        return None

    # --- the whole -----------------------------------------------------------------------

    def processes(self) -> list[Proc]:
        procs = [p for plane in self.control_planes for p in plane.services()]
        procs += [a.proc for a in self.agents.values() if a.proc is not None]
        return procs

    def stop(self) -> None:
        # Every agent is told at once (each stops its own shards), then the control planes.
        agents = [a.proc for a in self.agents.values() if a.proc is not None]
        for proc in agents:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        for proc in agents:
            proc.stop()
        for plane in self.control_planes:
            for service in plane.services():
                service.stop()
            for proxy in (plane.proxy, plane.reconciler_proxy):
                if proxy is not None:
                    proxy.close()
        # Engines of an agent that was killed outlive it (on purpose); end them here.
        for agent in self.agents.values():
            for pids in agent.engines().values():
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
        if self.redis_proxy is not None:
            self.redis_proxy.close()
        if self.redis is not None:
            self.redis.stop()


@contextmanager
def running_cluster(root: Path, *, redis_via_proxy: bool = False) -> Iterator[Cluster]:
    """A cluster under ``root`` with its Redis started (behind a proxy with
    ``redis_via_proxy``), and everything it started stopped on the way out."""
    cluster = Cluster(root)
    cluster.start_redis(via_proxy=redis_via_proxy)
    try:
        yield cluster
    finally:
        cluster.stop()


# --- Celery task events, as a monitor receives them ------------------------------------------


class Watcher:
    """Work done on a thread of its own for as long as a ``with watcher.running():`` lasts."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @contextmanager
    def running(self) -> Iterator[Self]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._halt()
            self._thread.join(30)

    def _run(self) -> None:
        raise NotImplementedError

    def _halt(self) -> None:
        """Wake the thread if it waits on something other than the stop event."""


class TaskEvents(Watcher):
    """The task events the workers send (``-E``), received on a thread of their own from the
    cluster's broker; it reconnects when the broker restarts."""

    def __init__(self, broker_url: str) -> None:
        super().__init__()
        self.broker_url = broker_url
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._receiver: Any = None

    def _halt(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("type", "").startswith("task-"):
            with self.lock:
                self.events.append(event)

    def _run(self) -> None:
        from kombu.connection import Connection

        from llmgw_site.celery import app

        while not self._stop.is_set():
            try:
                with Connection(self.broker_url) as conn:
                    self._receiver = app.events.Receiver(conn, handlers={"*": self._on_event})
                    if self._stop.is_set():  # asked to stop while connecting
                        return
                    self._receiver.capture(limit=None, timeout=None, wakeup=True)
            except Exception:  # the broker is down on purpose: try again
                self._stop.wait(0.2)

    def of(self, kind: str, *, host: str = "", after: float = 0.0) -> list[dict[str, Any]]:
        """Events ``task-KIND`` (received, started, succeeded, revoked...) from workers whose
        name starts with ``host``, stamped after ``after`` (epoch seconds)."""
        with self.lock:
            return [
                e
                for e in self.events
                if e["type"] == f"task-{kind}"
                and e.get("hostname", "").startswith(host)
                and e.get("timestamp", 0) > after
            ]


def queued_ticks(redis: RedisServer) -> int:
    """Tick messages waiting in the broker's queue, not yet taken by any worker."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=5) as sock:
        sock.sendall(b"LLEN celery\r\n")
        reply = sock.recv(64)
    assert reply.startswith(b":"), reply
    return int(reply[1:].split(b"\r\n")[0])


# --- leadership, as the database shows it --------------------------------------------------


def leader_worker(cluster: Cluster) -> ControlPlane | None:
    """The control plane whose worker holds the lease, live (owner ids embed the pid). A row
    past its expiry names nobody: after a store outage the last owner's row is there until
    the next claim, and taken for a leader it made "one leader stays" compare against a lease
    nobody held (CI, PostgreSQL pass: ('', 0) then the next claim's owner)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT owner FROM control_lease WHERE name = 'reconciler' "
            "AND expires_at_ms > llmgw_clock_ms()"
        )
        row = cursor.fetchone()
    if not row or not row[0]:
        return None
    pid = row[0].split(":")[1]
    return next((p for p in cluster.control_planes if p.worker and str(p.worker.pid) == pid), None)


def wait_leader(cluster: Cluster) -> ControlPlane:
    return wait_until(lambda: leader_worker(cluster), what="a leader", logs=cluster.processes())


def ticks_done(events: TaskEvents, plane: ControlPlane, after: float, count: int = 1) -> bool:
    """``plane``'s worker finished ``count`` ticks that it started after ``after``."""
    started = {e["uuid"] for e in events.of("started", host=plane.name, after=after)}
    done = [e for e in events.of("succeeded", host=plane.name) if e["uuid"] in started]
    return len(done) >= count


def wait_ticks(events: TaskEvents, plane: ControlPlane, after: float, count: int = 2) -> None:
    """Until ``plane``'s worker has run ``count`` whole ticks after ``after``: it has looked at
    the world as it is now (the positive signal before asserting that nothing changed)."""
    wait_until(
        lambda: ticks_done(events, plane, after, count),
        what=f"{count} ticks of {plane.name} after the change",
        logs=plane.services(),
    )


def lease_state() -> tuple[str, int]:
    """(owner, epoch) of the live reconciler lease; ("", 0) when nobody holds one."""
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


# --- the fleet, as the database shows it ---------------------------------------------------


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
    return str(Node.objects.filter(name=name).values_list("health", flat=True).first())


def heartbeat_after(name: str, moment: Any) -> bool:
    """The store has a heartbeat from node ``name`` later than ``moment``."""
    return Node.objects.filter(name=name, last_heartbeat_at__gt=moment).exists()


def store_violations() -> list[str]:
    """The two promises as the store shows them: no GPU or port of a node given to two shards
    that may run, no model with more running replicas than its maximum."""
    violations = []
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
            violations.append(f"store: node {node_id} gpu {gpu} given to shards {shards}")
    for (node_id, port), shards in ports.items():
        if len(shards) > 1:
            violations.append(f"store: node {node_id} port {port} given to {shards}")
    running = Counter(
        Replica.objects.filter(desired=Replica.Desired.RUNNING).values_list(
            "model__name", flat=True
        )
    )
    for name, most in ServedModel.objects.values_list("name", "max_replicas"):
        if running[name] > most:
            violations.append(f"store: model {name} has {running[name]} > {most}")
    return violations


class InvariantChecker(Watcher):
    """Reads the store and the live engines every ``interval`` seconds from its own thread
    and keeps every violation it sees."""

    def __init__(self, cluster: Cluster, interval: float = 0.2) -> None:
        super().__init__()
        self.cluster = cluster
        self.interval = interval
        self.violations: list[str] = []
        self.checks = 0

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
        self.violations += store_violations()

        in_use: dict[tuple[str, str], list[int]] = defaultdict(list)
        for pid, env in engine_processes():
            node = self.cluster.node_of_engine(pid)
            if node is None:
                continue
            for gpu in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
                if gpu:
                    in_use[(node, gpu)].append(pid)
        for (node, gpu), pids in in_use.items():
            if len(pids) > 1:
                self.violations.append(f"engines: {node} gpu {gpu} used by pids {pids}")
