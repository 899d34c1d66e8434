"""Starting and supervising llmgw's processes on one machine (``manage.py run``).

The web tier is several uvicorn processes (``llmgw_site.webserver``) accepting on listening
sockets that this process binds and hands down, so llmgw uses every core behind one port. A
child that dies is restarted with a capped backoff. Ctrl-C or SIGTERM stops every child and
waits the shutdown grace plus a margin (web processes drain their requests in flight) before
it kills any. SIGHUP replaces the web processes one at a time (a rolling restart): each new
one accepts before the one it replaces is told to drain, so a deploy drops no request.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# What a stopping child gets beyond the shutdown grace before it is killed.
STOP_MARGIN_SECONDS = 10.0
RESTART_BACKOFF_MAX = 30.0
# How long a rolling restart waits for a new web process to accept before it gives up.
READY_TIMEOUT_SECONDS = 60.0


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind a listening socket every web process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def web_command(
    listeners: Mapping[str, int], *, access_log: bool = False, app: str = ""
) -> list[str]:
    """A web process's argv: ``listeners`` maps each role (client, admin, metrics, agent) to
    the inherited descriptor it accepts on."""
    argv = [sys.executable, "-m", "llmgw_site.webserver"]
    for role, fd in listeners.items():
        argv += ["--listen", f"{role}={fd}"]
    if app:
        argv += ["--app", app]
    # Access lines cost a write per request; operators turn them on with LLMGW_ACCESS_LOG.
    if access_log:
        argv.append("--access-log")
    return argv


@dataclass
class Child:
    """One supervised process: how to start it, and its current incarnation.

    A ``rolling`` child (a web process) says when it accepts: it gets the write end of a pipe
    (``--ready-fd``) and writes one byte there once it is serving."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...] = ()
    rolling: bool = False
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start_at: float = 0.0
    started_at: float = field(default=0.0)
    ready_fd: int = -1

    def start(self) -> None:
        self._close_ready()
        argv, fds = list(self.argv), self.pass_fds
        write_end = -1
        if self.rolling:
            self.ready_fd, write_end = os.pipe()
            argv += ["--ready-fd", str(write_end)]
            fds = (*fds, write_end)
        try:
            self.process = subprocess.Popen(  # noqa: S603 - our own argv, no shell
                argv, env=dict(self.env), pass_fds=fds
            )
        finally:
            if write_end >= 0:
                os.close(write_end)
        self.started_at = time.monotonic()
        logger.info("started %s (pid %s)", self.name, self.process.pid)

    def wait_ready(self, timeout: float) -> bool:
        """True once the child said it accepts; False if it exits or ``timeout`` passes."""
        if self.ready_fd < 0:
            return True
        readable, _, _ = select.select([self.ready_fd], [], [], timeout)
        ready = bool(readable) and os.read(self.ready_fd, 1) == b"1"
        self._close_ready()
        return ready

    def _close_ready(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1


def restart_delay(restarts: int) -> float:
    """Capped exponential backoff, so a child that cannot start does not spin."""
    return float(min(RESTART_BACKOFF_MAX, 0.5 * 2 ** min(restarts, 10)))


class Supervisor:
    """Keeps a set of children running until asked to stop; SIGHUP rolls the web processes."""

    def __init__(
        self,
        children: Sequence[Child],
        *,
        stop_grace: float,
        listeners: Sequence[socket.socket] = (),
    ) -> None:
        self.children = list(children)
        self.stop_grace = stop_grace
        # The sockets the web processes accept on: this process keeps them for the web
        # processes a roll starts, and closes them when the whole tier stops.
        self.listeners = list(listeners)
        self.stopping = False
        self.roll_requested = False
        # Replaced web processes still finishing their requests: (process, kill deadline).
        self.draining: list[tuple[subprocess.Popen[bytes], float]] = []

    def request_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def request_roll(self, signum: int, frame: object) -> None:
        self.roll_requested = True

    def run(self) -> None:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_roll)
        for child in self.children:
            child.start()
        while not self.stopping:
            if self.roll_requested:
                self.roll_requested = False
                self.roll_web_processes()
            self._restart_exited()
            self._reap_draining()
            time.sleep(0.2)
        self.stop_all()

    def roll_web_processes(self) -> None:
        """Replace each web process in turn: start the new one, wait until it accepts, then
        tell the old one to drain (it stops accepting at once and finishes what it has)."""
        for child in self.children:
            if not child.rolling or child.process is None or self.stopping:
                continue
            old = child.process
            child.start()
            if not child.wait_ready(READY_TIMEOUT_SECONDS):
                logger.error(
                    "rolling restart stopped: the new %s did not start accepting; %s keeps serving",
                    child.name,
                    old.pid,
                )
                assert child.process is not None
                child.process.kill()
                child.process.wait()
                child.process = old
                return
            old.send_signal(signal.SIGTERM)
            self.draining.append((old, time.monotonic() + self.stop_grace + STOP_MARGIN_SECONDS))
            logger.info(
                "%s replaced: pid %s drains, pid %s serves", child.name, old.pid, child.process.pid
            )

    def _reap_draining(self) -> None:
        now = time.monotonic()
        still: list[tuple[subprocess.Popen[bytes], float]] = []
        for process, deadline in self.draining:
            if process.poll() is not None:
                continue
            if now >= deadline:
                logger.warning("pid %s did not drain in time; killing it", process.pid)
                process.kill()
                process.wait()
                continue
            still.append((process, deadline))
        self.draining = still

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
        """SIGTERM to every child, then the grace plus a margin before anything is killed:
        web processes finish their requests, the worker its tick."""
        running = [c.process for c in self.children if c.process and c.process.poll() is None]
        running += [process for process, _ in self.draining if process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        # The web processes close theirs as they begin to drain; while this copy stayed open,
        # the kernel went on completing new connections into a backlog nobody would accept
        # from, and clients hung until this process exited instead of being refused at once
        # (so that a balancer moves away).
        for listener in self.listeners:
            listener.close()
        wait = self.stop_grace + STOP_MARGIN_SECONDS
        deadline = time.monotonic() + wait
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %s did not stop in %.0fs; killing it", process.pid, wait)
                process.kill()
                process.wait()
        logger.info("all llmgw processes stopped")


def web_children(
    listeners: Mapping[str, socket.socket], count: int, *, access_log: bool
) -> list[Child]:
    env = dict(os.environ)
    fds = {role: sock.fileno() for role, sock in listeners.items()}
    argv = web_command(fds, access_log=access_log)
    return [
        Child(f"web-{i + 1}", argv, env, pass_fds=tuple(fds.values()), rolling=True)
        for i in range(count)
    ]
