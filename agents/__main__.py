"""``python -m agents`` (console script ``llmgw-agent``): the node program.

Run one on every GPU machine::

    LLMGW_NODE_TOKEN=llmgw_node_... python -m agents \\
        --control-plane https://cp1.example:8000 --control-plane https://cp2.example:8000 \\
        --node gpu-07 --weights-dir /srv/llmgw/weights

The token comes from ``--token-file`` or ``LLMGW_NODE_TOKEN`` (never from the command line,
where every user of the machine could read it in the process list).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import re
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agents import __version__, links, logs
from agents.agent import Agent, ConnectionConfig
from agents.engines import LaunchContext
from agents.gpus import discover, parse_simulated
from agents.protocol.names import valid_node_name
from agents.protocol.vocabulary import TOKEN_PREFIX
from agents.supervisor import Supervisor, SupervisorConfig

logger = logging.getLogger("agents")

_SIOCGIFADDR = 0x8915
DEFAULT_URL = "http://127.0.0.1:8000"


def _port_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range like 20000-20999")
    low, high = int(match.group(1)), int(match.group(2))
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: ports must be 1-65535, low <= high")
    return low, high


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    default_node = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:100]
    state_home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    parser = argparse.ArgumentParser(
        prog="python -m agents",
        description="llmgw node agent: reports this machine's GPUs to the control plane and "
        "runs the engine processes (shards) it is asked to run.",
        epilog="The node token is read from --token-file or the LLMGW_NODE_TOKEN environment "
        "variable; issue one with `manage.py issue_node_token NODE`.",
    )
    add = parser.add_argument
    add(
        "--control-plane",
        dest="urls",
        action="append",
        metavar="URL",
        help="control-plane address (http(s)://host:port or ws(s)://host:port/agents/stream); "
        "repeat for several, tried in turn. Default: LLMGW_CONTROL_PLANES (comma-separated) "
        "or http://127.0.0.1:8000",
    )
    add(
        "--transport",
        choices=links.TRANSPORTS,
        default=os.environ.get("LLMGW_AGENT_TRANSPORT") or links.WEBSOCKET,
        help="websocket (through any HTTP proxy; token) or grpc (HTTP/2; mutual TLS with "
        "--tls-cert, where the certificate is the node's identity) (default %(default)s)",
    )
    add("--token-file", type=Path, help="file holding this node's token")
    add("--tls-ca", type=Path, help="the cluster CA certificate to verify the control plane by")
    add("--tls-cert", type=Path, help="this node's certificate (`manage.py issue_node_cert`)")
    add("--tls-key", type=Path, help="this node's private key, beside --tls-cert")
    add(
        "--insecure",
        action="store_true",
        help="allow a control-plane URL without TLS to a host that is not loopback",
    )
    add(
        "--node",
        default=os.environ.get("LLMGW_NODE_NAME") or default_node,
        help="this node's name, as the token was issued for (default: the host name)",
    )
    add(
        "--advertise-address",
        dest="addresses",
        action="append",
        default=[],
        metavar="ADDR",
        help="address the gateway reaches this node's engines at (repeatable; default: the "
        "address of --management-interface, else the one used to reach the control plane)",
    )
    add(
        "--management-interface",
        default=os.environ.get("LLMGW_MANAGEMENT_INTERFACE") or None,
        metavar="IFACE",
        help="network interface whose IPv4 address is advertised (e.g. eth1)",
    )
    add(
        "--engine-host",
        help="address engines listen on (default: the first advertised address; engines are "
        "never bound to every interface unless this says 0.0.0.0)",
    )
    add(
        "--port-range",
        type=_port_range,
        default=os.environ.get("LLMGW_PORT_RANGE") or "20000-20999",
        help="ports engines may be given on this node (default %(default)s)",
    )
    add(
        "--weights-dir",
        type=Path,
        default=Path(os.environ.get("LLMGW_WEIGHTS_DIR") or state_home / "llmgw" / "weights"),
        help="where model weights live; relative sources resolve here (default %(default)s)",
    )
    add(
        "--state-dir",
        type=Path,
        default=state_home / "llmgw" / "agent",
        help="shard logs and the record of running shards (default %(default)s)",
    )
    add(
        "--simulate-gpus",
        metavar="SPEC",
        help="pretend to have GPUs, e.g. 2x80GiB (default: NVML when pynvml is installed)",
    )
    add(
        "--fallback-gpus",
        metavar="SPEC",
        help="simulated GPUs to use only when NVML finds none, e.g. 2x80GiB (for a local "
        "agent that uses real GPUs where there are some)",
    )
    add(
        "--engine-python",
        default=sys.executable,
        help="Python interpreter engines run with (default: this one)",
    )
    add(
        "--stop-grace",
        type=_positive,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping a shard (default %(default)s)",
    )
    add(
        "--leave-shards-running",
        action="store_true",
        help="on SIGTERM, exit without stopping shards; the next agent adopts them",
    )
    add(
        "--backoff-base",
        type=_positive,
        default=0.5,
        help="first reconnect delay, seconds (default %(default)s)",
    )
    add(
        "--backoff-max",
        type=_positive,
        default=5.0,
        help="longest reconnect delay, seconds; keep it well under the control plane's "
        "unreachable threshold, or a control-plane restart makes nodes look unreachable "
        "(default %(default)s)",
    )
    add(
        "--ping-timeout",
        type=_positive,
        default=10.0,
        help="seconds without a pong before the stream is considered dead (default %(default)s)",
    )
    add("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL") or "INFO")
    add(
        "--log-format",
        choices=logs.FORMATS,
        default=os.environ.get("LLMGW_LOG_FORMAT") or "plain",
        help="plain lines, or one JSON object a line (default: LLMGW_LOG_FORMAT, else plain)",
    )
    add("--version", action="version", version=f"llmgw-agent {__version__}")
    return parser


def interface_address(name: str) -> str:
    """The IPv4 address of a network interface (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
            )
        except OSError as exc:
            raise ValueError(f"interface {name!r} has no IPv4 address: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def route_address(host: str) -> str:
    """The local address this machine reaches ``host`` from (a UDP "connect" sends nothing):
    the address the gateway can reach this node's engines at, in the common case of one
    network; loopback when the control plane is on this machine."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ValueError(f"cannot resolve the control plane's host {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.connect(address)
        except OSError as exc:
            raise ValueError(f"no route to the control plane's host {host!r}: {exc}") from None
        return str(sock.getsockname()[0])


def read_token(token_file: Path | None, *, required: bool = True) -> str:
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --token-file {token_file}: {exc}") from None
        with contextlib.suppress(OSError):
            if token_file.stat().st_mode & 0o077:
                logger.warning("%s is readable by other users; chmod 600 it", token_file)
    else:
        token = os.environ.get("LLMGW_NODE_TOKEN", "").strip()
    if not token:
        if not required:
            return ""
        raise ValueError("no node token: pass --token-file or set LLMGW_NODE_TOKEN")
    if not token.startswith(TOKEN_PREFIX):
        raise ValueError(
            f"the node token does not start with {TOKEN_PREFIX!r}; is it a node token?"
        )
    return token


@dataclass(frozen=True)
class Plan:
    """The agent's configuration, checked before anything starts."""

    connection: ConnectionConfig
    supervisor: SupervisorConfig
    simulate_gpus: str | None
    fallback_gpus: str | None
    leave_shards_running: bool


def prepare(args: argparse.Namespace) -> Plan:
    """Turn the command line into a plan; ValueError names what is wrong."""
    tls = links.TlsFiles(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    if (tls.cert is None) != (tls.key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    for path in (tls.ca, tls.cert, tls.key):
        if path is not None and not path.is_file():
            raise ValueError(f"cannot read {path}")
    # With a client certificate over gRPC the certificate is the node's identity.
    token = read_token(
        args.token_file, required=not (args.transport == links.GRPC and tls.cert is not None)
    )
    urls_raw = args.urls or (os.environ.get("LLMGW_CONTROL_PLANES") or DEFAULT_URL).split(",")
    targets = tuple(
        links.parse_target(u, args.transport, insecure=args.insecure) for u in urls_raw if u.strip()
    )
    if not targets:
        raise ValueError("no control-plane URL given")
    addresses = list(args.addresses)
    if not addresses and args.management_interface:
        addresses.append(interface_address(args.management_interface))
    if not addresses:
        addresses.append(route_address(targets[0].host))
    # Engines listen where the gateway reaches them, and nowhere else.
    engine_host = args.engine_host or addresses[0]
    weights_dir: Path = args.weights_dir.expanduser().resolve()
    state_dir: Path = args.state_dir.expanduser().resolve()
    for folder in (weights_dir, state_dir):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create {folder}: {exc}") from None
    return Plan(
        connection=ConnectionConfig(
            urls=tuple(t.url for t in targets),
            transport=args.transport,
            tls=tls,
            insecure=args.insecure,
            token=token,
            token_file=args.token_file,
            node=args.node,
            addresses=tuple(addresses),
            port_range=args.port_range,
            backoff_base=args.backoff_base,
            backoff_max=args.backoff_max,
            ping_interval=args.ping_timeout,
            ping_timeout=args.ping_timeout,
        ),
        supervisor=SupervisorConfig(
            launch=LaunchContext(
                host=engine_host, python=args.engine_python, weights_dir=weights_dir
            ),
            state_dir=state_dir,
            port_range=args.port_range,
            stop_grace=args.stop_grace,
        ),
        simulate_gpus=args.simulate_gpus,
        fallback_gpus=args.fallback_gpus,
        leave_shards_running=args.leave_shards_running,
    )


async def run(plan: Plan) -> int:
    """Run until SIGTERM or SIGINT, then stop the shards (unless told to leave them)."""
    node = plan.connection.node
    gpus = discover(plan.simulate_gpus, node, fallback=plan.fallback_gpus)
    supervisor = Supervisor(plan.supervisor, gpus)
    agent = Agent(plan.connection, supervisor)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    low, high = plan.supervisor.port_range
    logger.info(
        "llmgw-agent %s: node %s, %d GPU(s), control plane(s) %s, engines on %s ports %s-%s, "
        "weights in %s",
        __version__,
        node,
        len(gpus.read()),
        ", ".join(plan.connection.urls),
        plan.supervisor.launch.host,
        low,
        high,
        plan.supervisor.launch.weights_dir,
    )
    supervisor.recover()
    disconnect = asyncio.Event()
    link = asyncio.create_task(agent.run(disconnect))
    await stop.wait()
    logger.info("shutting down%s", " (leaving shards running)" if plan.leave_shards_running else "")
    # Shards first, while the stream is still up, so the control plane hears that they
    # stopped (and the gateway stops routing to them) instead of waiting for a timeout.
    await supervisor.shutdown(leave_running=plan.leave_shards_running)
    await agent.report_now()
    disconnect.set()
    try:
        await asyncio.wait_for(link, timeout=5)
    except TimeoutError:
        logger.warning("the control-plane link did not close in time")
    logger.info("agent stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (
        args.log_format not in logs.FORMATS
    ):  # from LLMGW_LOG_FORMAT, which argparse leaves unchecked
        parser.error(f"LLMGW_LOG_FORMAT={args.log_format!r}: use one of {', '.join(logs.FORMATS)}")
    logs.configure(
        args.log_format,
        str(args.log_level).upper(),
        plain=f"%(asctime)s %(levelname)s agent[{args.node}] %(name)s: %(message)s",
        fields={"process": "agent", "node": args.node},
    )
    # One line per health or metrics poll would drown what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not valid_node_name(args.node):
        parser.error(f"--node {args.node!r}: use 1-100 letters, digits, '-' or '_'")
    for spec in (args.simulate_gpus, args.fallback_gpus):
        if spec:
            try:
                parse_simulated(spec, args.node)
            except ValueError as exc:
                parser.error(str(exc))
    try:
        plan = prepare(args)
    except ValueError as exc:  # bad configuration: say which, exit before anything starts
        logger.error("%s", exc)
        return 2
    return asyncio.run(run(plan))


if __name__ == "__main__":
    sys.exit(main())
