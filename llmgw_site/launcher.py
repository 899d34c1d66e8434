"""Starting and supervising llmgw's processes on one machine (``manage.py run``).

The web tier is several Daphne processes accepting on one listening socket that this process
binds and hands down (``daphne --fd``), so llmgw uses every core behind one port. A child that
dies is restarted with a capped backoff; Ctrl-C or SIGTERM stops every child, then this process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 10.0
RESTART_BACKOFF_MAX = 30.0


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind the one listening socket every web process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def daphne_command(fd: int, *, access_log: bool = False) -> list[str]:
    daphne = Path(sys.executable).with_name("daphne")
    program = [str(daphne)] if daphne.exists() else [sys.executable, "-m", "daphne"]
    # Access lines cost a write per request; operators turn them on with LLMGW_ACCESS_LOG.
    logging_args = ["--access-log", "-"] if access_log else ["--verbosity", "0"]
    return [*program, "--fd", str(fd), *logging_args, "llmgw_site.asgi:application"]


@dataclass
class Child:
    """One supervised process: how to start it, and its current incarnation."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start_at: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.process = subprocess.Popen(  # noqa: S603 - our own argv, no shell
            list(self.argv), env=dict(self.env), pass_fds=self.pass_fds
        )
        self.started_at = time.monotonic()
        logger.info("started %s (pid %s)", self.name, self.process.pid)


def restart_delay(restarts: int) -> float:
    """Capped exponential backoff, so a child that cannot start does not spin."""
    return float(min(RESTART_BACKOFF_MAX, 0.5 * 2 ** min(restarts, 10)))


class Supervisor:
    """Keeps a set of children running until asked to stop."""

    def __init__(self, children: Sequence[Child]) -> None:
        self.children = list(children)
        self.stopping = False

    def request_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> None:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)
        for child in self.children:
            child.start()
        while not self.stopping:
            self._restart_exited()
            time.sleep(0.2)
        self.stop_all()

    def _restart_exited(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.process is None:
                if now >= child.next_start_at:
                    child.start()
                continue
            code = child.process.poll()
            if code is None:
                if now - child.started_at > RESTART_BACKOFF_MAX:
                    child.restarts = 0  # it stayed up: forget earlier crashes
                continue
            delay = restart_delay(child.restarts)
            logger.warning("%s exited with %s; restarting in %.1fs", child.name, code, delay)
            child.restarts += 1
            child.process = None
            child.next_start_at = now + delay

    def stop_all(self) -> None:
        running = [c.process for c in self.children if c.process and c.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "pid %s did not stop in %.0fs; killing it", process.pid, STOP_GRACE_SECONDS
                )
                process.kill()
                process.wait()
        logger.info("all llmgw processes stopped")


def web_children(listener: socket.socket, count: int, *, access_log: bool) -> list[Child]:
    env = dict(os.environ)
    fd = listener.fileno()
    argv = daphne_command(fd, access_log=access_log)
    return [Child(f"web-{i + 1}", argv, env, pass_fds=(fd,)) for i in range(count)]
