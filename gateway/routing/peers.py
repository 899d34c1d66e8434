"""Placements shared by the web processes of one host: what each of them routed where.

Each web process's mirrors (``gateway.routing.mirrors``) would otherwise see only the requests
that process took. Two processes behind one listening socket take the turns of one
conversation in any order: the process that takes the second turn knew nothing of the first,
found the history cached nowhere, and could place it afresh, away from the upstream that holds
it. So every placement is told to the host's other web processes too. (Their loads, and where a
new prefix was first placed, they share on the host's board, ``gateway.routing.board``, which
is read the moment it changes; a placement's every block key is too much for it, and a
conversation's next turn comes seconds later anyway.)

Each web process binds a Unix datagram socket, named by its pid, in a folder the processes of
one var folder share (``LLMGW_VAR_DIR/routing-peers``, owner-only as the var folder is). After a
choice, the upstream and the prompt's block keys are queued; every 20 ms at most the queue goes
out as one datagram to every peer found in the folder, without waiting: a peer whose queue is
full misses it and routes as it would have alone, so a slow peer never slows this one. Each
process reads its socket as a reader of its loop and holds what it is told in its own mirrors,
exactly as if it had routed the request itself. Nothing here is on a request's path but
appending to a list; nothing crosses the host (processes on other hosts agree by the rendezvous
order of ``gateway.routing.choice``).

A datagram is checked before anything is held: its kind, each record's length, the upstream id
as UTF-8; one that does not parse is dropped whole, and the caller holds only ids of upstreams
it routes to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gateway.routing.board import process_alive

logger = logging.getLogger(__name__)

MAGIC = b"LGP3"
# The header: the sender's pid (u32). Then placement records: the upstream id's length (u16),
# the id, the number of keys (u16), the keys (u64).
_HEADER = struct.Struct("<I")
_ID_LEN = struct.Struct("<H")
_COUNT = struct.Struct("<H")
_KEY = 8
# Under the smallest datagram a Linux host's default socket buffers carry whole (about 200 KiB),
# so a batch is never refused for its size; a larger batch goes as several datagrams.
MAX_DATAGRAM = 60 * 1024
MAX_ID_BYTES = 512
_U32 = 0xFFFFFFFF
# A prompt's leading blocks are what a later request can share; past these a placement is sent
# short (a peer holds the head of the prompt, which is what any match starts with).
MAX_KEYS = 1024
SCAN_SECONDS = 2.0  # how often the folder is listed for peers that started or stopped
# What is queued goes out this long after the first of it: a datagram for each request woke
# every peer for each (make bench: +0.4 ms p50 and +0.2 ms CPU a request at one client);
# batched, a peer wakes at most 50 times a second, and a conversation's next turn comes seconds
# later anyway.
FLUSH_DELAY_S = 0.02
MAX_PEERS = 64  # peers told (a host runs a few web processes)
_SOCKET_NAME = re.compile(r"^(\d+)\.sock$")

Hold = Callable[[str, tuple[int, ...]], None]


Placements = list[tuple[str, tuple[int, ...]]]


def _name(upstream_id: str) -> bytes:
    return upstream_id.encode("utf-8", "surrogatepass")[:MAX_ID_BYTES]


def encode(pid: int, placements: Placements) -> Iterator[bytes]:
    """Datagrams carrying ``placements`` (upstream id, block keys), each under MAX_DATAGRAM;
    one datagram (a hello, when there are none)."""
    head = MAGIC + _HEADER.pack(pid)
    parts: list[bytes] = [head]
    size = len(head)
    for upstream_id, all_keys in placements:
        name = _name(upstream_id)
        keys = all_keys[:MAX_KEYS]
        record = b"".join(
            (
                _ID_LEN.pack(len(name)),
                name,
                _COUNT.pack(len(keys)),
                struct.pack(f"<{len(keys)}Q", *keys),
            )
        )
        if size + len(record) > MAX_DATAGRAM and len(parts) > 1:
            yield b"".join(parts)
            parts, size = [head], len(head)
        parts.append(record)
        size += len(record)
    yield b"".join(parts)


def _upstream_id(view: memoryview, at: int, after: int) -> tuple[str, int]:
    """An id record's id and where what follows it starts (``after`` bytes must follow)."""
    if at + _ID_LEN.size > len(view):
        raise ValueError("a record cut short")
    (id_len,) = _ID_LEN.unpack_from(view, at)
    at += _ID_LEN.size
    if not 0 < id_len <= MAX_ID_BYTES or at + id_len + after > len(view):
        raise ValueError("an upstream id of a bad length")
    return bytes(view[at : at + id_len]).decode("utf-8"), at + id_len


def decode(data: bytes) -> tuple[int, Placements]:
    """The sender's pid and the placements in one datagram; ValueError when any part of it
    does not parse."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER.size:
        raise ValueError("not a placements datagram")
    view = memoryview(data)
    (pid,) = _HEADER.unpack_from(view, len(MAGIC))
    at = len(MAGIC) + _HEADER.size
    out: Placements = []
    while at < len(view):
        upstream_id, at = _upstream_id(view, at, _COUNT.size)
        (count,) = _COUNT.unpack_from(view, at)
        at += _COUNT.size
        if count > MAX_KEYS or at + count * _KEY > len(view):
            raise ValueError("a key count past the record")
        keys = struct.unpack_from(f"<{count}Q", view, at)
        at += count * _KEY
        out.append((upstream_id, keys))
    return pid, out


class Peers:
    """This process's end of the host's placement exchange (module docstring)."""

    def __init__(self, folder: Path, hold: Hold, *, pid: int = 0) -> None:
        self.folder = folder
        self.hold = hold
        self._flush_due = False
        self.pid = pid or os.getpid()  # its socket's name (another only in tests)
        self._dir_fd = -1
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[str, tuple[int, ...]]] = []
        self._peers: list[str] = []  # their socket names in the folder
        self._scanned_at = -SCAN_SECONDS
        self.sent = 0
        self.received = 0
        self.dropped = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Bind this process's socket and read it on ``loop``; False (and nothing shared) where
        the host cannot, as a process routes well enough on its own."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            name = self._path(f"{self.pid}.sock")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)  # a socket left by an earlier process that had this pid
            sock.bind(name)
            sock.setblocking(False)
            loop.add_reader(sock.fileno(), self._read)
        except OSError as error:
            logger.warning("routing placements are not shared with this host's peers: %s", error)
            self.close()
            return False
        self._sock, self._loop = sock, loop
        # Said at once to the processes already here, so they know of this one before their
        # next look at the folder (a datagram from a pid they do not know adds it).
        self._scanned_at = time.monotonic()
        self._peers = self._scan()
        self._send(encode(self.pid, []))
        return True

    def _path(self, name: str) -> str:
        # Through the folder's descriptor: a Unix socket's path is limited to 107 bytes, a var
        # folder's (a test's temporary one, an operator's) is not.
        return f"/proc/self/fd/{self._dir_fd}/{name}"

    def tell(self, upstream_id: str, keys: tuple[int, ...]) -> None:
        """Queue a placement for the peers; the queue goes out within FLUSH_DELAY_S."""
        if self._sock is None or not keys:
            return
        self._pending.append((upstream_id, keys))
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            assert self._loop is not None
            self._loop.call_later(FLUSH_DELAY_S, self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        pending, self._pending = self._pending, []
        if self._sock is None:
            return
        now = time.monotonic()
        if now - self._scanned_at >= SCAN_SECONDS:
            self._scanned_at = now
            self._peers = self._scan()
        if not self._peers or not pending:
            return
        self._send(encode(self.pid, pending))

    def _send(self, datagrams: Iterator[bytes]) -> None:
        sock = self._sock
        assert sock is not None
        for data in datagrams:
            for peer in list(self._peers):
                try:
                    sock.sendto(data, self._path(peer))
                    self.sent += 1
                except BlockingIOError:
                    self.dropped += 1  # its queue is full: it routes alone for a moment
                except (ConnectionRefusedError, FileNotFoundError):
                    self._peers.remove(peer)  # it stopped; the next scan sees its socket go
                except OSError as error:
                    self.dropped += 1
                    logger.debug("placement not sent to %s: %s", peer, error)

    def _scan(self) -> list[str]:
        try:
            names = os.listdir(self._dir_fd)
        except OSError:
            return []
        peers = []
        for name in names:
            found = _SOCKET_NAME.match(name)
            if found is None or int(found.group(1)) == self.pid:
                continue
            if not process_alive(int(found.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(self._path(name))  # left by a process that is gone
                continue
            peers.append(name)
        return peers

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(64):  # then the loop's other work, and the rest at its next turn
            try:
                data = sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                pid, placements = decode(data)
            except (ValueError, UnicodeDecodeError, struct.error):
                self.dropped += 1
                continue
            self.received += 1
            self._heard(pid)
            for upstream_id, keys in placements:
                self.hold(upstream_id, keys)

    def _heard(self, pid: int) -> None:
        """A datagram from ``pid``: a peer that started since this process last looked is
        told from now on."""
        name = f"{pid}.sock"
        if pid != self.pid and name not in self._peers and len(self._peers) < MAX_PEERS:
            self._peers.append(name)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(sock.fileno())
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self._path(f"{self.pid}.sock"))
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
