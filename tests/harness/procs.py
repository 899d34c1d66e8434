"""Real processes on loopback: one wrapper for every process a test starts.

A :class:`Proc` writes its output to a log file (one per incarnation), so a failing wait can
show what each process said; it is signalled, stopped (SIGTERM, then SIGKILL) and killed the
same way whatever it runs. Web processes start the way ``manage.py run`` starts them: on a
listening socket bound here and handed down, with the argv the launcher builds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw_site import launcher
from tests.harness.waits import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
PORT_WINDOW = 50


def free_port() -> int:
    """A TCP port on loopback that nothing is bound to right now, from a window of ports this
    test process holds (:func:`port_window`). Not one the kernel picks: a port from its
    ephemeral range is free only until the kernel hands it out again, to any connection's local
    end or any ``bind(0)`` on the machine, and a server told to listen there a moment later
    found it taken ("Address already in use")."""
    global _next_listener
    for _ in range(2):
        for _ in range(len(_listener_ports)):
            port = _listener_ports[_next_listener % len(_listener_ports)]
            _next_listener += 1
            if bindable(port):
                return port
        low, high = port_window()
        _listener_ports.extend(range(low, high + 1))
    raise AssertionError("no free port in this process's windows or a new one")


_listener_ports: list[int] = []  # the windows this process took for free_port, in order
_next_listener = 0  # where free_port looks next: it goes round them, oldest use first


def bindable(port: int) -> bool:
    """Nothing is bound to 127.0.0.1:``port`` (without SO_REUSEADDR: not even a closing
    connection)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# A window drawn by a test process is locked here until that process ends, so that two runs on
# one machine (the SQLite and PostgreSQL passes, their workers) never draw the same one: a
# window's ports are free when it is drawn, but its engines start only later.
_WINDOW_LOCKS = Path(tempfile.gettempdir()) / "llmgw-test-port-windows"
_held_windows: dict[int, int] = {}  # window start -> the open descriptor holding its lock


def port_window(taken: Collection[int] = ()) -> tuple[int, int]:
    """A window of ``PORT_WINDOW`` engine ports, none in use now, below the kernel's ephemeral
    range (so no connection's local end or ``bind(0)`` takes one), and held by no other test
    process on this machine. ``taken``: window starts already given out."""
    for _ in range(400):
        low = random.randrange(21000, 32000 - PORT_WINDOW, PORT_WINDOW)
        if low in taken or low in _held_windows:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(low, low + PORT_WINDOW):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _hold(low):
            return low, low + PORT_WINDOW - 1
    raise AssertionError("no free window of engine ports")


def _hold(low: int) -> bool:
    """Lock the window starting at ``low`` for this process; False if another holds it."""
    _WINDOW_LOCKS.mkdir(exist_ok=True)
    lock = os.open(_WINDOW_LOCKS / str(low), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return False
    _held_windows[low] = lock
    return True


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _log_path(directory: Path, name: str) -> Path:
    """A log file of its own for each incarnation, so a successor's log holds only what it did."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        candidate = directory / (f"{stem}.log" if n == 0 else f"{stem}.{n}.log")
        if not candidate.exists():
            return candidate
    raise AssertionError(f"too many logs for {name} in {directory}")


@dataclass
class Proc:
    """One child process and its log file."""

    name: str
    argv: Sequence[str]
    log_dir: Path
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    port: int = 0  # where it serves, if it does
    cwd: Path = REPO_ROOT
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self, *, pass_fds: Sequence[int] = ()) -> Proc:
        """Start a new incarnation (a restart keeps the name, the argv and the port)."""
        self.log_path = _log_path(self.log_dir, self.name)
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                list(self.argv),
                env=dict(self.env),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=tuple(pass_fds),
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    @property
    def url(self) -> str:
        assert self.port, f"{self.name} serves no port"
        return f"http://127.0.0.1:{self.port}"

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.running():
            os.kill(self.pid, signum)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (after SIGCONT: a paused process cannot act on it), then SIGKILL after
        ``timeout``; the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(30)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def log(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_listening(self, timeout: float = 60.0) -> Proc:
        """Until its port accepts connections; fail with its log if it exits first."""
        port = self.port
        assert port, f"{self.name} serves no port"
        wait_until(
            lambda: port_open(port),
            timeout,
            f"{self.name} listening on {port}",
            logs=[self],
            running=[self],
        )
        return self

    def wait_answering(self, path: str = "/v1/models", timeout: float = 60.0) -> Proc:
        """Until it answers HTTP on ``path`` (any status): the application is loaded."""

        def answers() -> bool:
            try:
                with urllib.request.urlopen(self.url + path, timeout=5):
                    return True
            except urllib.error.HTTPError:
                return True
            except OSError:
                return False

        wait_until(answers, timeout, f"{self.name} answering {path}", logs=[self], running=[self])
        return self


# --------------------------------------------------------------------------- web processes


def web_process(
    name: str,
    log_dir: Path,
    env: Mapping[str, str],
    *,
    port: int = 0,
    access_log: bool = False,
    app: str = "",
    cwd: Path = REPO_ROOT,
) -> Proc:
    """A web process started as ``manage.py run`` starts each of its own: the launcher binds
    the listening socket and builds the server's argv; the child accepts on the inherited
    descriptor. Our copy of the socket is closed once the child has it, so when the process
    dies, connections are refused as they would be in production. ``app`` serves another
    ASGI application on the same server (the benchmark's baselines); ``cwd`` another checkout's
    code (the benchmark's ``BENCH_BASELINE``)."""
    listener = launcher.bind_listener("127.0.0.1", port)
    try:
        bound = int(listener.getsockname()[1])
        argv = launcher.web_command({"client": listener.fileno()}, access_log=access_log, app=app)
        proc = Proc(name, argv, log_dir, env, port=bound, cwd=cwd)
        proc.start(pass_fds=(listener.fileno(),))
    finally:
        listener.close()
    return proc.wait_answering()


# --------------------------------------------------------------------------- engines and sockets


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def engine_port(pid: int) -> int | None:
    argv = _cmdline(pid)
    if "--port" in argv:
        with contextlib.suppress(ValueError, IndexError):
            return int(argv[argv.index("--port") + 1])
    return None


def engine_processes(ports: tuple[int, int] = (1, 65535)) -> Iterator[tuple[int, dict[str, str]]]:
    """Live ``agents.sim`` engines started by an agent (they carry LLMGW_SHARD_ID), serving a
    port in ``ports`` (a test's own window: other runs on this machine have engines too)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if "agents.sim" not in _cmdline(pid) or not alive(pid):
            continue
        if not ports[0] <= (engine_port(pid) or 0) <= ports[1]:
            continue
        try:
            raw = (entry / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if "LLMGW_SHARD_ID" in env:
            yield pid, env


def connections_to(pid: int, port: int) -> set[int]:
    """Socket inodes of the established TCP connections ``pid`` holds to ``port`` on loopback:
    the same inode before and after means the same connection, never re-opened."""
    inodes: set[int] = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    except OSError:
        return set()
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                established = fields[3] == "01"
                if established and remote_port == port and int(fields[9]) in inodes:
                    found.add(int(fields[9]))
    return found
