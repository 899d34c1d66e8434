"""The agents' WebSocket streams on uvicorn (the web process ``manage.py run`` starts) and on
daphne (Channels' own server), side by side in one run.

For each server in turn, rounds alternating: one server process on a fresh port, then
``--nodes`` simulated nodes (``python -m agents.fleet``: the real agent) all dialling it at
once. Measured: seconds until every node is connected and has been sent its desired state
(the storm a restarted control plane sees), the server's CPU in that storm, and then its CPU
per second and RSS over ``--steady`` seconds of heartbeats. PostgreSQL (a database this run
drops and creates) and a Redis of its own, as ``bench.fleet``.

    python -m bench.agent_servers [--nodes 500] [--rounds 2] [--steady 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import cpu_seconds, rss_mib
from tests.harness.waits import wait_until

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "var" / "bench-agent-servers"


def start_server(kind: str, env: dict[str, str], logs: Path) -> Any:
    from tests.harness.procs import Proc, free_port, web_process

    if kind == "uvicorn":
        return web_process("uvicorn", logs, env)
    port = free_port()
    argv = [str(Path(sys.executable).with_name("daphne")), "-b", "127.0.0.1", "-p", str(port)]
    argv += ["--verbosity", "0", "llmgw_site.asgi:application"]
    return Proc("daphne", argv, logs, env, port=port).start().wait_answering()


def one_round(kind: str, nodes: int, steady: float, env: dict[str, str]) -> dict[str, Any]:
    from tests.harness.procs import PYTHON, Proc

    logs = WORK / "logs"
    stats_path = WORK / f"fleet-{kind}.json"
    stats_path.unlink(missing_ok=True)
    server = start_server(kind, env, logs)
    fleet = None
    try:
        argv = [
            PYTHON, "-m", "agents.fleet",
            "--control-plane", server.url,
            "--tokens", str(WORK / "tokens.json"),
            "--nodes", str(nodes),
            "--state-dir", str(WORK / f"nodes-{kind}"),
            "--stats-file", str(stats_path),
            "--stats-interval", "0.2",
            "--ramp", "0",
        ]  # fmt: skip
        agent_env = {k: v for k, v in env.items() if not k.startswith(("DATABASE_", "LLMGW_"))}
        cpu_before = cpu_seconds(server.pid)
        started = time.monotonic()
        fleet = Proc(f"fleet-{kind}", argv, logs, agent_env).start()

        def stats() -> dict[str, Any]:
            try:
                return dict(json.loads(stats_path.read_text()))
            except (OSError, ValueError):
                return {}

        def all_served() -> bool:
            current = stats()
            return bool(current.get("served", 0) >= nodes and current.get("connected", 0) >= nodes)

        procs = (server, fleet)
        wait_until(
            all_served,
            180.0,
            f"{kind}: {nodes} nodes served",
            interval=0.1,
            logs=procs,
            running=procs,
        )
        storm_s = time.monotonic() - started
        storm_cpu = cpu_seconds(server.pid) - cpu_before
        cpu_before, began = cpu_seconds(server.pid), time.monotonic()
        time.sleep(steady)
        steady_cpu = (cpu_seconds(server.pid) - cpu_before) / (time.monotonic() - began)
        final = stats()
        return {
            "server": kind,
            "storm_s": storm_s,
            "storm_cpu_s": storm_cpu,
            "steady_cpu_per_s": steady_cpu,
            "rss_mib": rss_mib(server.pid),
            "refused": final.get("refused", 0),
            "connected": final.get("connected", 0),
        }
    finally:
        for proc in (fleet, server):
            if proc is not None:
                proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of heartbeats")
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_AGENTS_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw_bench_agents"
        ),
        help="a PostgreSQL database this run drops and creates",
    )
    parser.add_argument("--json", type=Path, default=REPO / "var" / "bench-agent-servers.json")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    from bench import django_on
    from bench.fleet.store import fresh_database

    fresh_database(args.database_url)
    env = django_on(args.database_url, WORK)
    from control import node_tokens
    from tests.harness.redis import RedisServer

    names = [f"fleet-{i:04d}" for i in range(args.nodes)]
    tokens = WORK / "tokens.json"
    tokens.write_text(json.dumps({name: node_tokens.issue_node_token(name) for name in names}))
    tokens.chmod(0o600)
    redis = RedisServer(WORK / "redis").start()
    try:
        env["REDIS_URL"] = redis.url
        rounds = [
            one_round(kind, args.nodes, args.steady, env)
            for _ in range(args.rounds)
            for kind in ("uvicorn", "daphne")
        ]
    finally:
        redis.stop()
    print(f"\n{args.nodes} agents' WebSocket streams, {args.rounds} rounds each (median)")
    print(f"{'server':10} {'storm s':>8} {'storm CPU s':>12} {'steady CPU/s':>13} {'RSS MiB':>8}")
    summary = {}
    for kind in ("uvicorn", "daphne"):
        mine = [r for r in rounds if r["server"] == kind]
        row = {
            key: statistics.median(r[key] for r in mine)
            for key in ("storm_s", "storm_cpu_s", "steady_cpu_per_s", "rss_mib")
        }
        summary[kind] = row
        print(
            f"{kind:10} {row['storm_s']:8.2f} {row['storm_cpu_s']:12.2f} "
            f"{row['steady_cpu_per_s']:13.3f} {row['rss_mib']:8.0f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rounds": rounds, "summary": summary}, indent=2))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
