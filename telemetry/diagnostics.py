"""Each process answers diagnostic requests about itself on a private channel, and whoever
asks (the admin's diagnostics page, ``manage.py diagnose``) gathers every process's answer.

The channel is a Unix socket per process, ``<folder>/<pid>.sock``, in a folder of the var
folder (owner-only: ``llmgw_site.owner_only``), the socket itself 0600: only the user llmgw
runs as can connect, as only that user could ptrace the process anyway. Chosen over the
channel layer and over Redis pub-sub because it works the same on the embedded default (whose
in-process channel layer cannot reach another process, and which has no Redis) and in
production, needs no service to be up (a store or a Redis that is down is often why someone
is looking), and is answered by a thread of its own: a process whose event loop is stuck
still says where it is stuck. It reaches the processes of one host: each host's admin
listener (and ``manage.py diagnose`` there) shows that host's processes.

A request is one JSON line, ``{"op": ..., "args": {...}}``; the answer is one JSON document,
then the connection closes. Each connection is served by a short-lived thread, so a profile of
ten seconds does not hold up a look at the stacks. Idle, the channel is one thread blocked in
``accept`` and a socket file.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry import heap, profiler, stacks, vitals

logger = logging.getLogger(__name__)

SUFFIX = ".sock"
MAX_REQUEST_BYTES = 64 * 1024
MAX_PROFILE_S = 120.0
# A process that has not answered within this (plus a profile's length) is reported as silent:
# one stuck process must not hold up the answers of the others.
ANSWER_TIMEOUT_S = 10.0
THREAD_NAME = "llmgw diagnostics"
# sockaddr_un holds 108 bytes: a longer path is reached through the folder's descriptor.
_MAX_SOCKET_PATH = 100


@dataclass
class Process:
    """What this process says about itself: its name (``web``, ``worker``, ``beat``...), its
    event loop (if it has one), the peers whose connections it counts, and further facts
    (``extras``: name -> a function answering it) its owner knows how to tell."""

    role: str
    loop: asyncio.AbstractEventLoop | None = None
    peers: tuple[vitals.Peer, ...] = ()
    extras: Mapping[str, Callable[[], object]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    lag: vitals.LoopLag | None = None
    profiling: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.connections = vitals.Connections(self.peers)

    def info(self) -> dict[str, Any]:
        extras: dict[str, object] = {}
        for name, tell in self.extras.items():
            try:
                extras[name] = tell()
            except Exception as exc:  # one fact that cannot be had spoils none of the others
                extras[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "started_at": self.started,
            "uptime_s": round(time.time() - self.started, 1),
            "memory": vitals.memory(),
            "threads": vitals.thread_counts(),
            "loop_lag": self.lag.report() if self.lag else None,
            "connections": self.connections.count(),
            "tracemalloc": heap.status()["tracing"],
            "profiling": self.profiling.locked(),
            **extras,
        }

    def profile(self, args: Mapping[str, Any]) -> dict[str, Any]:
        seconds = float(args.get("seconds", 5))
        if not 0 < seconds <= MAX_PROFILE_S:
            raise ValueError(f"seconds must be above 0 and at most {MAX_PROFILE_S:g}")
        hz = float(args.get("hz", profiler.DEFAULT_HZ))
        if not 1 <= hz <= 1000:
            raise ValueError("hz must be between 1 and 1000")
        if not self.profiling.acquire(blocking=False):
            raise ValueError("a profile of this process is already being taken")
        try:
            # The channel's own threads (waiting to be asked, answering) are not the process's.
            mode = str(args.get("mode", "cpu"))
            return profiler.profile(seconds, hz=hz, mode=mode, unseen=THREAD_NAME)
        finally:
            self.profiling.release()

    def heap(self, args: Mapping[str, Any]) -> dict[str, Any]:
        action = args.get("action", "report")
        if action == "start":
            return heap.start(int(args.get("frames", heap.DEFAULT_FRAMES)))
        if action == "stop":
            return heap.stop()
        if action == "rebase":
            return heap.rebase()
        if action == "report":
            return heap.report(int(args.get("top", 20)))
        raise ValueError("action must be start, stop, rebase or report")

    def answer(self, op: str, args: Mapping[str, Any]) -> object:
        if op == "info":
            return self.info()
        if op == "stacks":
            return stacks.snapshot(self.loop)
        if op == "profile":
            return self.profile(args)
        if op == "heap":
            return self.heap(args)
        if op == "objects":
            return heap.objects(int(args.get("top", 30)))
        raise ValueError(f"no such diagnostic: {op!r}")


OPS = ("info", "stacks", "profile", "heap", "objects")


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """``path`` as a socket address: itself, or (too long for sockaddr_un) the same file
    through a descriptor of its folder (Linux's /proc/self/fd)."""
    if len(os.fsencode(path)) < _MAX_SOCKET_PATH:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def socket_path(folder: Path, pid: int) -> Path:
    return folder / f"{pid}{SUFFIX}"


@dataclass
class Channel:
    """This process's listening socket and the thread that accepts on it."""

    process: Process
    path: Path
    listener: socket.socket
    host: str = field(default_factory=socket.gethostname)

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed: the process is stopping
            threading.Thread(
                target=self.serve_one, args=(conn,), name=f"{THREAD_NAME} request", daemon=True
            ).start()

    def serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(ANSWER_TIMEOUT_S)
                request = json.loads(_read_line(conn))
                op = str(request.get("op", ""))
                args = request.get("args") or {}
                if not isinstance(args, dict):
                    raise ValueError("args must be an object")
                body: dict[str, Any] = {"answer": self.process.answer(op, args)}
            except (ValueError, TypeError, OSError) as exc:
                body = {"error": str(exc)}
            except Exception as exc:
                logger.exception("diagnostics: the request failed")
                body = {"error": f"{type(exc).__name__}: {exc}"}
            head = {"pid": os.getpid(), "role": self.process.role, "host": self.host}
            with contextlib.suppress(OSError):  # the asker gave up meanwhile
                conn.settimeout(None)
                conn.sendall(json.dumps({**head, **body}, default=str).encode() + b"\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError("request too long")
    return data.split(b"\n", 1)[0]


_channel: Channel | None = None


def serve(folder: Path, process: Process) -> Channel:
    """Answer diagnostic requests for this process on ``folder/<pid>.sock`` from now until it
    exits (the socket file is removed then); a second call replaces the first's process."""
    global _channel
    if _channel is not None:
        _channel.process = process
        return _channel
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = socket_path(folder, os.getpid())
    # Bound and listening under another name first, then renamed into place: a socket file
    # of this name always has a listener while its process lives, so an asker that finds it
    # refusing knows its process is gone (and removes it).
    making = path.with_name(f"{path.name}.new")
    for stale in (path, making):  # a dead process's: nobody else can be this pid now
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with _address(making) as address:
        listener.bind(address)
    os.chmod(making, 0o600)
    listener.listen(16)
    making.rename(path)
    if process.loop is not None and process.lag is None:
        process.lag = vitals.LoopLag()
        process.lag.start(process.loop)
    _channel = Channel(process, path, listener)
    channel_thread = f"{THREAD_NAME} channel"
    threading.Thread(target=_channel.serve_forever, name=channel_thread, daemon=True).start()
    atexit.register(_channel.close)
    return _channel


# --------------------------------------------------------------------------- asking


def ask(path: Path, op: str, args: Mapping[str, Any] | None = None, *, timeout: float) -> Any:
    """One process's answer, ``{"pid", "role", "host", "answer" | "error"}``; None where no
    process is there any more (its socket file is removed then)."""
    pid = int(path.stem) if path.stem.isdigit() else None
    request = json.dumps({"op": op, "args": dict(args or {})}).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, _address(path) as address:
            conn.settimeout(timeout)
            conn.connect(address)
            conn.sendall(request)
            chunks: list[bytes] = []
            while chunk := conn.recv(1 << 16):
                chunks.append(chunk)
        return json.loads(b"".join(chunks))
    except ConnectionRefusedError:
        # Nobody listens: a process that died without removing its file (SIGKILL, a crash).
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    except FileNotFoundError:  # it stopped, and removed its file, since the folder was read
        return None
    except TimeoutError:
        return {"pid": pid, "error": f"no answer within {timeout:g}s"}
    except (OSError, ValueError) as exc:
        return {"pid": pid, "error": f"no answer: {exc}"}


def gather(
    folder: Path,
    op: str,
    args: Mapping[str, Any] | None = None,
    *,
    pids: Collection[int] = (),
    timeout: float = ANSWER_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Every process's answer (those of ``pids`` only, if given), asked at the same time; in
    order of pid. A profile's answers wait for its seconds on top of ``timeout``."""
    paths = sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []
    if pids:
        wanted = {str(pid) for pid in pids}
        paths = [path for path in paths if path.stem in wanted]
    if op == "profile":
        timeout += float((args or {}).get("seconds", 5))
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
        answers = list(pool.map(lambda path: ask(path, op, args, timeout=timeout), paths))
    found = [answer for answer in answers if answer is not None]
    return sorted(found, key=lambda answer: int(answer.get("pid") or 0))
