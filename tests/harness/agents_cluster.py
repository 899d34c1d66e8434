"""Real processes for the agent end-to-end tests: Daphne, agents, a private Redis, and waits
that poll with a deadline. Each process logs to a file the test can read and show on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from agents.shards import process_start_ticks
from tests.harness.procs import REPO_ROOT, free_port
from tests.harness.store import child_env

T = TypeVar("T")
BIN = Path(sys.executable).parent


def wait_for(
    check: Callable[[], T | bool | None],
    *,
    timeout: float = 15.0,
    what: str = "",
    interval: float = 0.05,
    logs: Sequence[Proc] = (),
) -> T:
    """Poll ``check`` until it returns something truthy; fail with the processes' log tails."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} ---\n{p.tail()}" for p in logs)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")
        time.sleep(interval)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Proc:
    """One child process, its log file, and the signals tests send it."""

    name: str
    argv: list[str]
    env: Mapping[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    cwd: Path = REPO_ROOT

    def start(self) -> Proc:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                env=dict(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.running():
            os.kill(self.pid, signum)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def count(self, text: str) -> int:
        return self.log().count(text)


def start_redis(port: int, log_path: Path) -> Proc:
    """A Redis nobody else uses (so a test may stop and restart it), keeping nothing on disk."""
    proc = Proc(
        "redis",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--protected-mode", "no"],
        dict(os.environ),
        log_path,
    ).start()  # fmt: skip
    wait_for(lambda: port_open(port), timeout=10, what="redis listening", logs=[proc])
    return proc


@dataclass
class Cluster:
    """Daphne (the control plane's web process) and agents on loopback, all real processes."""

    root: Path
    redis_url: str
    daphne_env: dict[str, str]
    port: int = field(default_factory=free_port)
    daphne: Proc | None = None
    agents: dict[str, Proc] = field(default_factory=dict)
    others: list[Proc] = field(default_factory=list)  # more web processes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_daphne(self, *, port: int | None = None, **env: str) -> Proc:
        """Start the web process (on the cluster's port, or another for a second one)."""
        port = port or self.port
        merged = child_env(
            REDIS_URL=self.redis_url,
            LLMGW_VAR_DIR=str(self.root / "var"),
            **{**self.daphne_env, **env},
        )
        proc = Proc(
            f"daphne:{port}",
            [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port),
             "llmgw_site.asgi:application"],
            merged,
            self.root / f"daphne-{port}.log",
        ).start()  # fmt: skip
        wait_for(
            lambda: port_open(port) or not proc.running(),
            timeout=30,
            what="daphne listening",
            logs=[proc],
        )
        assert proc.running(), proc.tail()
        if port == self.port:
            self.daphne = proc
        else:
            self.others.append(proc)
        return proc

    def stop_daphne(self) -> None:
        if self.daphne is not None:
            self.daphne.stop()

    def state_dir(self, node: str) -> Path:
        return self.root / node / "state"

    def weights_dir(self, node: str) -> Path:
        return self.root / node / "weights"

    def token_file(self, node: str) -> Path:
        return self.root / node / "token"

    def start_agent(
        self, node: str, *extra: str, gpus: str = "2x80GiB", urls: Sequence[str] = ()
    ) -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_", "LLMGW_"))}
        proc = Proc(
            f"agent {node}",
            [sys.executable, "-m", "agents",
             *[a for u in (urls or [self.url]) for a in ("--control-plane", u)],
             "--token-file", str(self.token_file(node)),
             "--node", node,
             "--advertise-address", "127.0.0.1",
             "--simulate-gpus", gpus,
             "--port-range", "1024-65535",
             "--state-dir", str(self.state_dir(node)),
             "--weights-dir", str(self.weights_dir(node)),
             "--stop-grace", "3",
             "--backoff-base", "0.2",
             "--backoff-max", "1",
             "--ping-timeout", "3",
             *extra],
            env,
            # One log per incarnation, so a successor's log holds only what it did.
            self.root / f"agent-{node}-{len(list(self.root.glob(f'agent-{node}-*.log')))}.log",
        ).start()  # fmt: skip
        self.agents[node] = proc
        return proc

    def processes(self) -> list[Proc]:
        return [p for p in [self.daphne, *self.others, *self.agents.values()] if p is not None]

    def shard_pids(self, node: str) -> dict[int, int]:
        """Shard id → engine pid, from the agent's own record of what it runs."""
        try:
            data = json.loads((self.state_dir(node) / "shards.json").read_text())
        except (OSError, ValueError):
            return {}
        return {
            int(s["spec"]["shard_id"]): int(s["pid"])
            for s in data.get("shards", [])
            if process_start_ticks(int(s["pid"])) == s["start"]  # still that very process
        }

    def stop(self) -> None:
        # Every agent is told at once (each stops its own shards), then the web processes.
        for agent in self.agents.values():
            agent.signal(signal.SIGCONT)
            agent.signal(signal.SIGTERM)
        for agent in self.agents.values():
            agent.stop()
        for web in [self.daphne, *self.others]:
            if web is not None:
                web.signal(signal.SIGTERM)
        for web in [self.daphne, *self.others]:
            if web is not None:
                web.stop()
        # Engines of an agent that was killed outlive it (on purpose); end them here.
        for node in self.agents:
            for pid in self.shard_pids(node).values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
