"""How this process is doing, cheaply: its resident memory, its threads, its open connections
to the store and Redis, and how late its event loop runs what it was asked to.

Connections are the kernel's view (``/proc``), not a driver's: a connection a pool leaked or a
thread forgot is counted as surely as one in use, and no driver needs asking. A *peer* names
what to count: TCP connections to a host and port (PostgreSQL, Redis), or descriptors open on
a file (an SQLite store: each connection holds its file open).

The event loop's lag comes from one callback that asks to run every ``interval`` seconds and
notes how late it ran: a loop stalled by a blocking call or a long collection shows it within
a tick. One callback every half second is all it costs (``make bench`` prices it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import os
import resource
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAG_INTERVAL_S = 0.5
LAG_WINDOW = 120  # ticks remembered: the last minute at the interval above
_ESTABLISHED = "01"


def memory() -> dict[str, int | None]:
    """Resident memory now and at its peak, in bytes (the peak only, where /proc is missing)."""
    fields = _status()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rss_bytes": fields.get("VmRSS"),
        "rss_peak_bytes": fields.get("VmHWM", peak),
    }


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                scale = 1024 if parts[1:] == ["kB"] else 1
                out[name] = int(parts[0]) * scale
    return out


def thread_counts() -> dict[str, int | None]:
    """Python's threads, and all of the process's (C libraries start their own)."""
    return {"python": threading.active_count(), "os": _status().get("Threads")}


@dataclass(frozen=True)
class Peer:
    """What to count the open connections to: ``host`` and ``port`` (TCP), or ``path`` (a
    file held open); neither, where it cannot be told (a Unix socket's peer)."""

    name: str
    host: str = ""
    port: int = 0
    path: str = ""

    def where(self) -> str:
        if self.path:
            return self.path
        return f"{self.host}:{self.port}" if self.host else "unknown"


@dataclass
class Connections:
    """Counts each peer's connections, resolving its host once (lazily: never at start-up)."""

    peers: tuple[Peer, ...]
    _addresses: dict[str, frozenset[str]] = field(default_factory=dict)

    def _resolved(self, peer: Peer) -> frozenset[str]:
        known = self._addresses.get(peer.host)
        if known is None:
            try:
                infos = socket.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
                known = frozenset(_plain(str(info[4][0])) for info in infos)
            except OSError:
                known = frozenset()
            self._addresses[peer.host] = known
        return known

    def count(self) -> list[dict[str, Any]]:
        descriptors = _descriptors()
        sockets = (
            _tcp_peers({int(t[8:-1]) for t in descriptors if t.startswith("socket:[")})
            if descriptors is not None
            else None
        )
        out: list[dict[str, Any]] = []
        for peer in self.peers:
            count: int | None = None
            if peer.path and descriptors is not None:
                path = os.path.realpath(peer.path)
                count = sum(1 for target in descriptors if target == path)
            elif peer.host and sockets is not None:
                addresses = self._resolved(peer)
                count = sum(
                    1 for host, port, state in sockets
                    if port == peer.port and host in addresses and state == _ESTABLISHED
                )  # fmt: skip
            out.append({"name": peer.name, "where": peer.where(), "open": count})
        return out


def _descriptors() -> list[str] | None:
    """Where each of this process's descriptors points ("socket:[inode]" for a socket); None
    where /proc cannot tell."""
    targets: list[str] = []
    try:
        entries = list(os.scandir("/proc/self/fd"))
    except OSError:
        return None
    for entry in entries:
        with contextlib.suppress(OSError):  # closed meanwhile
            targets.append(os.readlink(entry.path))
    return targets


def _plain(address: str) -> str:
    """An IPv4 address mapped into IPv6 as the IPv4 address itself, so both spellings match."""
    with contextlib.suppress(ValueError):
        parsed = ipaddress.ip_address(address.split("%", maxsplit=1)[0])
        if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(parsed)
    return address


def _decode(hex_address: str) -> tuple[str, int]:
    """/proc/net/tcp's ``0100007F:1538`` as ("127.0.0.1", 5432): each 32-bit word of the
    address in the host's byte order (little-endian here), the port in hex."""
    raw, _, port = hex_address.partition(":")
    packed = b"".join(int(raw[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(raw), 8))
    return _plain(str(ipaddress.ip_address(packed))), int(port, 16)


def _tcp_peers(inodes: set[int]) -> list[tuple[str, int, str]] | None:
    """(remote address, remote port, state) of the TCP sockets among ``inodes``; None where
    /proc cannot tell."""
    found: list[tuple[str, int, str]] = []
    readable = False
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and int(fields[9]) in inodes:
                host, port = _decode(fields[2])
                found.append((host, port, fields[3]))
    return found if readable else None


class LoopLag:
    """How late the event loop runs a callback due every ``interval`` seconds (timed by the
    process's own clock: uvloop's is in whole milliseconds)."""

    def __init__(self, interval: float = LAG_INTERVAL_S) -> None:
        self.interval = interval
        self.lags: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin ticking on ``loop`` (from any thread)."""
        self._loop = loop
        loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        assert self._loop is not None
        self._due = time.perf_counter() + self.interval
        self._loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        self.lags.append(max(0.0, time.perf_counter() - self._due))
        self._arm()

    def report(self) -> dict[str, Any]:
        lags = list(self.lags)
        return {
            "interval_s": self.interval,
            "last_ms": round(lags[-1] * 1000, 2) if lags else None,
            "max_ms": round(max(lags) * 1000, 2) if lags else None,
            "mean_ms": round(sum(lags) / len(lags) * 1000, 2) if lags else None,
            "window_s": round(len(lags) * self.interval, 1),
        }
