"""``python -m agents.fleet``: a fleet of simulated nodes in one process, for measuring the
control plane at the size of a real cluster.

Each node is the real agent: an :class:`~agents.agent.Agent` (the WebSocket stream, hello,
status and heartbeats, reconnects with capped backoff and jitter, failover between
control-plane addresses) feeding a :class:`~agents.supervisor.Supervisor` (desired state,
epochs, the pure plan, each shard's lifecycle, health polls over HTTP). Only the engine
process is replaced: the launcher starts the ``sim`` engine's own server
(:class:`~agents.sim.SimServer`) inside this process instead of forking one, so a thousand
nodes with several engines each fit on one machine. Each node has a loopback address of its
own (``127.1.x.y``, all of 127/8 is loopback on Linux), so its engines take the ports the
control plane gives them exactly as a separate host would, and answer ``/v1`` and ``/health``
on them; an engine is ready ``--ready-delay`` seconds after it starts.

The process writes what it sees to ``--stats-file`` (JSON, replaced atomically) every
``--stats-interval`` seconds: how many nodes are connected and where, how many were served
their desired state on their current stream, handshakes refused, engines live and ready, and
any GPU that two live engines of one node were given at once (which the control plane must
never do). Tokens come from ``--tokens``, a JSON object of node name to node token, read once.

    python -m agents.fleet --control-plane http://127.0.0.1:8000 --tokens tokens.json \\
        --nodes 1000 --gpus-per-node 8 --ready-delay 2 --stats-file fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.exceptions import InvalidStatus

from agents import links
from agents.agent import Agent, ConnectionConfig, stream_url
from agents.engines import Launch, LaunchContext
from agents.gpus import SimulatedGpus, parse_simulated
from agents.processes import ProcessMark
from agents.protocol.messages import DesiredShard, DesiredState, Welcome
from agents.protocol.names import valid_node_name
from agents.sim import SimConfig, SimServer
from agents.supervisor import Supervisor, SupervisorConfig

logger = logging.getLogger("agents.fleet")

# Exit codes an in-process engine reports, as a child process would: a clean exit after
# SIGTERM, and SIGKILL's.
_TERMINATED = 0
_KILLED = -9


def node_name(prefix: str, index: int) -> str:
    return f"{prefix}{index:04d}"


def node_address(index: int) -> str:
    """Node ``index``'s own loopback address: 127.1.0.1, 127.1.0.2, ... (65,534 nodes)."""
    number = index + 1
    if not 0 < number < 65535:
        raise ValueError(f"node index {index} out of range")
    return f"127.1.{number >> 8}.{number & 0xFF}"


# --------------------------------------------------------------------------- engines


@dataclass
class GpuLedger:
    """Which live in-process engines use which GPU of one node, and every time two did."""

    holders: dict[int, set[int]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)

    def take(self, node: str, shard_id: int, gpus: Sequence[int]) -> None:
        for gpu in gpus:
            users = self.holders.setdefault(gpu, set())
            if users - {shard_id}:
                self.conflicts.append(
                    f"{node} gpu {gpu}: shard {shard_id} started while {sorted(users)} run"
                )
            users.add(shard_id)

    def give_back(self, shard_id: int, gpus: Sequence[int]) -> None:
        for gpu in gpus:
            self.holders.get(gpu, set()).discard(shard_id)


class InProcessEngine:
    """A :class:`~agents.processes.ProcessHandle` for a sim server running in this process."""

    def __init__(self, server: SimServer, spec: DesiredShard, ledger: GpuLedger) -> None:
        self.server = server
        self.spec = spec
        self.ledger = ledger
        self._code: int | None = None
        self._closing: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return os.getpid()

    def poll(self) -> int | None:
        return self._code

    def exited(self) -> bool:
        return self._code is not None

    def terminate(self) -> None:
        self._end(_TERMINATED, grace=None)

    def kill(self) -> None:
        self._end(_KILLED, grace=0.0)

    def mark(self) -> ProcessMark | None:
        return None  # it lives inside this process: nothing for a later agent to adopt

    def _end(self, code: int, grace: float | None) -> None:
        if self._closing is not None and grace is None:
            return
        self._closing = asyncio.ensure_future(self._close(code, grace))

    async def _close(self, code: int, grace: float | None) -> None:
        await self.server.close(grace)
        if self._code is None:
            self._code = code
            self.ledger.give_back(self.spec.shard_id, self.spec.gpu_indices)


class InProcessLauncher:
    """Starts each shard as a sim server on the node's own address, ready after a delay."""

    def __init__(self, node: str, host: str, ready_delay: float, ledger: GpuLedger) -> None:
        self.node = node
        self.host = host
        self.ready_delay = ready_delay
        self.ledger = ledger
        self.engines: dict[int, InProcessEngine] = {}

    async def __call__(
        self, spec: DesiredShard, command: Launch, log_path: Path, cwd: Path
    ) -> InProcessEngine:
        server = SimServer(
            SimConfig(
                model=spec.model,
                host=self.host,
                port=spec.port,
                startup_delay=self.ready_delay,
                shutdown_grace=1.0,
            )
        )
        await server.start()  # OSError (port taken) fails the shard, as a failed exec would
        self.ledger.take(self.node, spec.shard_id, spec.gpu_indices)
        engine = InProcessEngine(server, spec, self.ledger)
        self.engines[spec.shard_id] = engine
        return engine

    def live(self) -> list[InProcessEngine]:
        return [e for e in self.engines.values() if not e.exited()]


# --------------------------------------------------------------------------- one node


class FleetSupervisor(Supervisor):
    """The real supervisor; it also notes when it last took a desired state."""

    applied_at = 0.0

    def apply(self, desired: DesiredState) -> bool:
        taken = super().apply(desired)
        if taken:
            self.applied_at = time.monotonic()
        return taken


class FleetAgent(Agent):
    """The real agent; it also counts refusals and notes where and when it was welcomed."""

    supervisor: FleetSupervisor

    def __init__(self, config: ConnectionConfig, supervisor: FleetSupervisor) -> None:
        super().__init__(config, supervisor)
        self.refused = 0
        self.welcomed_at = 0.0
        self.url = ""

    async def _connect(self, target: links.Target, stop: asyncio.Event) -> bool:
        self.url = target.url
        try:
            return await super()._connect(target, stop)
        except (InvalidStatus, links.Refused):
            self.refused += 1
            raise

    async def _handshake(self, link: links.Link) -> Welcome | None:
        welcome = await super()._handshake(link)
        if welcome is None:
            self.refused += 1
        else:
            self.welcomed_at = time.monotonic()
        return welcome

    @property
    def connected(self) -> bool:
        return self._link is not None

    @property
    def served(self) -> bool:
        """Connected, and given its desired state on this very stream."""
        return self.connected and self.supervisor.applied_at >= self.welcomed_at > 0


# --------------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class FleetConfig:
    urls: tuple[str, ...]
    tokens: dict[str, str]
    nodes: int
    gpus: str
    prefix: str = "fleet-"
    first: int = 0
    ready_delay: float = 2.0
    port_range: tuple[int, int] = (20000, 20999)
    state_root: Path = Path(tempfile.gettempdir()) / "llmgw-fleet"
    backoff_base: float = 0.5
    backoff_max: float = 5.0
    ramp: float = 5.0
    # Engines of a thousand nodes are polled by one process: slower than a real agent's
    # defaults, so the fleet measures the control plane rather than itself.
    poll_interval: float = 2.0
    metrics_every: int = 5
    stats_file: Path | None = None
    stats_interval: float = 1.0


@dataclass
class Node:
    name: str
    agent: FleetAgent
    launcher: InProcessLauncher


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.ledger_conflicts: list[str] = []
        self.nodes: list[Node] = []
        for i in range(config.first, config.first + config.nodes):
            name = node_name(config.prefix, i)
            token = config.tokens.get(name)
            if token is None:
                raise ValueError(f"no token for node {name} in the tokens file")
            address = node_address(i)
            ledger = GpuLedger(conflicts=self.ledger_conflicts)
            launcher = InProcessLauncher(name, address, config.ready_delay, ledger)
            state_dir = config.state_root / name
            supervisor = FleetSupervisor(
                SupervisorConfig(
                    launch=LaunchContext(
                        host=address, python=sys.executable, weights_dir=state_dir / "weights"
                    ),
                    state_dir=state_dir,
                    port_range=config.port_range,
                    stop_grace=2.0,
                    poll_interval=config.poll_interval,
                    metrics_every=config.metrics_every,
                ),
                SimulatedGpus(parse_simulated(config.gpus, name)),
                launcher=launcher,
            )
            # Each node lists the control planes starting at a different one, as a fleet
            # behind no load balancer would be configured, so streams spread over them.
            turn = i % len(config.urls)
            agent = FleetAgent(
                ConnectionConfig(
                    urls=config.urls[turn:] + config.urls[:turn],
                    token=token,
                    node=name,
                    addresses=(address,),
                    port_range=config.port_range,
                    backoff_base=config.backoff_base,
                    backoff_max=config.backoff_max,
                ),
                supervisor,
            )
            self.nodes.append(Node(name, agent, launcher))

    async def run(self, stop: asyncio.Event) -> None:
        disconnect = asyncio.Event()
        links = [
            asyncio.create_task(self._node(node, disconnect, i), name=node.name)
            for i, node in enumerate(self.nodes)
        ]
        stats = asyncio.create_task(self._write_stats(stop))
        await stop.wait()
        await asyncio.gather(
            *(n.agent.supervisor.shutdown(leave_running=False) for n in self.nodes),
            return_exceptions=True,
        )
        disconnect.set()
        await asyncio.wait(links, timeout=10)
        stats.cancel()
        self.write_stats()

    async def _node(self, node: Node, disconnect: asyncio.Event, i: int) -> None:
        # Machines do not boot in the same millisecond: spread the first connections.
        if self.config.ramp > 0:
            await asyncio.sleep(self.config.ramp * i / max(1, len(self.nodes)))
        node.agent.supervisor.recover()
        await node.agent.run(disconnect)

    async def _write_stats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.write_stats()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.stats_interval)

    def stats(self) -> dict[str, Any]:
        by_url: dict[str, int] = {}
        for node in self.nodes:
            if node.agent.connected:
                by_url[node.agent.url] = by_url.get(node.agent.url, 0) + 1
        live = [e for n in self.nodes for e in n.launcher.live()]
        return {
            "time": time.time(),
            "nodes": len(self.nodes),
            "connected": sum(by_url.values()),
            "connected_by_url": by_url,
            "served": sum(1 for n in self.nodes if n.agent.served),
            "connections": sum(n.agent.connections for n in self.nodes),
            "refused": sum(n.agent.refused for n in self.nodes),
            "stale_rejected": sum(n.agent.supervisor.stale_rejected for n in self.nodes),
            "engines_live": len(live),
            "engines_ready": sum(1 for e in live if e.server.ready),
            "gpu_conflicts": self.ledger_conflicts[:50],
            "gpu_conflict_count": len(self.ledger_conflicts),
        }

    def write_stats(self) -> None:
        path = self.config.stats_file
        if path is None:
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.stats()))
        tmp.replace(path)


# --------------------------------------------------------------------------- the command


def _read_tokens(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read --tokens {path}: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ValueError(f"--tokens {path}: expected a JSON object of node name to token")
    return data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m agents.fleet",
        description="Run many simulated nodes (the real agent, engines in-process) in one "
        "process, against a real control plane.",
    )
    add = parser.add_argument
    add("--control-plane", dest="urls", action="append", required=True, metavar="URL")
    add("--tokens", type=Path, required=True, help="JSON object: node name -> node token")
    add("--nodes", type=int, required=True, help="how many nodes")
    add("--first", type=int, default=0, help="index of the first node (default 0)")
    add("--gpus-per-node", type=int, default=8)
    add("--gpu-memory", default="80GiB", help="each GPU's memory (default %(default)s)")
    add("--prefix", default="fleet-", help="node names are PREFIX0000, PREFIX0001, ...")
    add("--ready-delay", type=float, default=2.0, help="seconds until an engine is ready")
    add("--port-range", default="20000-20999", help="engine ports on every node")
    add("--state-dir", type=Path, default=Path(tempfile.gettempdir()) / "llmgw-fleet")
    add("--backoff-base", type=float, default=0.5)
    add("--backoff-max", type=float, default=5.0)
    add("--ramp", type=float, default=5.0, help="seconds over which nodes first connect")
    add("--stats-file", type=Path)
    add("--stats-interval", type=float, default=1.0)
    add("--log-level", default="WARNING")
    return parser


def prepare(args: argparse.Namespace) -> FleetConfig:
    if not 1 <= args.nodes <= 65000:
        raise ValueError("--nodes: 1-65000")
    if not 1 <= args.gpus_per_node <= 64:
        raise ValueError("--gpus-per-node: 1-64")
    if args.ready_delay < 0 or args.ramp < 0 or args.stats_interval <= 0:
        raise ValueError("--ready-delay and --ramp must be >= 0, --stats-interval > 0")
    low, _, high = str(args.port_range).partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= 65535):
        raise ValueError(f"--port-range {args.port_range!r}: expected LOW-HIGH")
    for i in (args.first, args.first + args.nodes - 1):
        if not valid_node_name(node_name(args.prefix, i)):
            raise ValueError(f"--prefix {args.prefix!r} makes invalid node names")
    return FleetConfig(
        urls=tuple(stream_url(u) for u in args.urls),
        tokens=_read_tokens(args.tokens),
        nodes=args.nodes,
        first=args.first,
        gpus=f"{args.gpus_per_node}x{args.gpu_memory}",
        prefix=args.prefix,
        ready_delay=args.ready_delay,
        port_range=(int(low), int(high)),
        state_root=args.state_dir,
        backoff_base=args.backoff_base,
        backoff_max=args.backoff_max,
        ramp=args.ramp,
        stats_file=args.stats_file,
        stats_interval=args.stats_interval,
    )


async def run(config: FleetConfig) -> int:
    fleet = Fleet(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.warning(
        "fleet of %d node(s) (%s each) connecting to %s",
        config.nodes,
        config.gpus,
        ", ".join(config.urls),
    )
    await fleet.run(stop)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s fleet %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = prepare(args)
        parse_simulated(config.gpus, "check")
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    return asyncio.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
