"""The host's board: the routing state the web processes of one host share through memory.

The web processes behind one listening socket take one burst's requests side by side, each
choosing within microseconds of the others. Counts told by message arrive too late for that:
the other process has already sent its half of the burst where its own counts looked best, and
a new prefix's first requests have been placed twice. So what the choice needs of the host as
it is *now* lives on a board that every process maps into its memory: reading and writing it is
reading and writing memory, with no system call and nothing to wait for.

The board is a file of fixed size in the host's var folder (``routing-peers/board-v1``,
owner-only as the folder is), mapped shared by each web process. It holds:

- **slots**, one per web process: its pid and a heartbeat, and for each upstream its
  outstanding requests, those of them awaiting a first byte (queued for the engine's prefill),
  the prompt bytes those bring to be prefilled, when the oldest of them was sent and when the
  last first byte came. A process
  writes only its own slot; a reader sums the live slots. A process that died leaves its slot:
  its heartbeat ages past ``SLOT_STALE_S``, readers skip it, and the next process to start
  takes it over, zeroed.
- **the registry**: each upstream id (a 64-bit hash of it) and the column of every slot that
  counts it, so the processes count one upstream in one place. An entry no process has used for
  ``REGISTRY_IDLE_S`` may be given to another upstream.
- **homes**: where this host first placed each new prefix (its first blocks' keys,
  ``gateway.routing.prefix``) and when. A request of that prefix through another process, which
  has not yet heard of the placement (``gateway.routing.peers``), goes to the same upstream
  instead of placing the prefix a second time, as far as the two prompts' blocks agree. A home
  is claimed under the board's lock (``flock``), so two processes placing one new prefix at the
  same instant agree on one upstream; it is trusted for ``HOME_TTL_S``.

Clock: ``time.monotonic()``, which on Linux is the host's, the same in every process.

Everything read here was written by a process of ours, yet a value out of range (a torn read,
a damaged file) must not stop a request: a column past the registry, a count that cannot be
real, is read as nothing there. Where the board cannot be opened (no folder, a file system
that cannot map it) each process routes on its own counts, as it did before the board.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

logger = logging.getLogger(__name__)

NAME = "board-v3"
MAGIC = b"LLMGWBD3"
SLOTS = 64  # web processes of one host, at most
UPSTREAMS = 512  # upstreams the host routes to at once, at most
HOMES = 16_384  # new prefixes remembered (a probe window each; the oldest make room)
HOME_PROBES = 4
HOME_KEYS = 16  # a placement's first blocks given a home (a prompt's first 48 KiB or so)
REGISTRY_PROBES = 16
SLOT_STALE_S = 5.0  # a slot not heartbeaten for this long counts for nothing
HOME_TTL_S = 60.0
HOME_TTL_TENTHS = int(HOME_TTL_S * 10)
REGISTRY_IDLE_S = 600.0
MAX_PID = 1 << 22  # Linux's largest pid_max
# A count no real process reaches: a larger one read is a torn or damaged value, read as 0.
MAX_COUNT = 1 << 24
MAX_PENDING = 1 << 40  # bytes of prompt awaiting prefill, likewise
LIVE_EVERY_S = 0.1  # how often the live slots are looked at again
# How long a process waits for the board's lock. A placement holds it well under a millisecond,
# but a process stopped while holding it (SIGSTOP, a debugger's attach, a frozen container)
# holds it until it runs again, and ``flock`` has no timeout: every other web process of the
# host would stop at its next new prompt, all its streams with it. Past the wait a process
# places without the lock (as it would on a host without a board)...
LOCK_WAIT_S = 0.05
# ...and for this long does not wait for it again, so one stopped process costs the others one
# wait, not one per request.
LOCK_GIVEN_UP_S = 1.0
# Opening the board (claiming a slot, once at start) waits longer: a process that gave up here
# would route on its own counts for its whole life, so only a holder that is not coming back
# soon may make it.
OPEN_LOCK_WAIT_S = 2.0

_HEADER = struct.Struct("<8sIIII")  # magic, slots, upstreams, homes, slots ever claimed
_HEADER_SIZE = 64
_SLOT = 16  # pid (u32), unused (u32), heartbeat (f64)
_ENTRY = 16  # registry: id hash (u64), last used (f64)
# A cell, one per (slot, upstream): outstanding requests, those awaiting a first byte, the prompt
# bytes they bring to prefill (i64 each), when the oldest of them was sent, when the last first
# byte came (f64 each), read and written whole by one call each.
_CELL = struct.Struct("<qqqdd")
# A home: a prompt block's key, its column, when (tenths of a second from the epoch).
_HOME = struct.Struct("<QH2xI")
_CLAIMED_AT = 20  # in the header: how many slots were ever claimed

_SLOTS_AT = _HEADER_SIZE
_REGISTRY_AT = _SLOTS_AT + SLOTS * _SLOT
_COUNTS_AT = _REGISTRY_AT + UPSTREAMS * _ENTRY
_HOMES_AT = _COUNTS_AT + SLOTS * UPSTREAMS * _CELL.size
_EPOCH_AT = _HOMES_AT + HOMES * _HOME.size  # f64: the clock's reading the homes count from
SIZE = _EPOCH_AT + 8


def id_hash(upstream_id: str) -> int:
    """An upstream id as a registry key: never 0 (an empty entry)."""
    return xxhash.xxh3_64_intdigest(upstream_id.encode("utf-8", "surrogatepass")) or 1


class HostCounts(NamedTuple):
    """The live slots' sums for some columns, in their order."""

    outstanding: list[int]
    awaiting: list[int]
    pending: list[int]  # prompt bytes awaiting prefill
    oldest: list[float]  # when the oldest awaiting request was sent (0.0: none awaits)
    answered: list[float]  # when the last first byte came (0.0: none yet)


class Board:
    """This process's handle on the host's board (module docstring)."""

    def __init__(self, fd: int, mapped: mmap.mmap, slot: int, pid: int) -> None:
        self._fd = fd
        self._map = mapped
        view = memoryview(mapped)
        self._view = view
        self._slots_u32 = view[_SLOTS_AT:_REGISTRY_AT].cast("I")
        self._slots_f64 = view[_SLOTS_AT:_REGISTRY_AT].cast("d")
        self._registry_u64 = view[_REGISTRY_AT:_COUNTS_AT].cast("Q")
        self._registry_f64 = view[_REGISTRY_AT:_COUNTS_AT].cast("d")

        self._homes = view[_HOMES_AT:_EPOCH_AT]
        self._epoch = view[_EPOCH_AT:SIZE].cast("d")
        self.slot = slot
        self.pid = pid
        self._depth = 0  # how deep this process is in a placement (``locked``)
        self._holds = False  # whether the placement holds the lock (it may have gone without)
        self._given_up_until = -math.inf  # the lock was not to be had: not waited for till then
        self._live: list[int] = []  # the live slots, as last looked at...
        self._live_at = -math.inf  # ...then

    def is_locked(self) -> bool:
        """Whether this process is placing a prompt now (in ``locked``, the lock held or, where
        it was not to be had, gone without): what it reads of the others is read fresh."""
        return self._depth > 0

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the board's lock (``flock``) for a placement: re-entrant in this process, so a
        choice made under it may claim a home under it too. Waited for ``LOCK_WAIT_S`` at most;
        where it is not to be had by then (a process stopped holding it), the placement goes
        on without it, and placements do not wait again for ``LOCK_GIVEN_UP_S``."""
        if self._depth == 0:
            self._holds = self._take_lock()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._holds:
                self._holds = False
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _take_lock(self) -> bool:
        now = time.monotonic()
        if now < self._given_up_until:
            return False
        if _acquire(self._fd, LOCK_WAIT_S):
            return True
        self._given_up_until = time.monotonic() + LOCK_GIVEN_UP_S
        logger.warning(
            "the host's routing board stayed locked for %.0f ms (a web process stopped while "
            "holding it?): placing new prompts without it for %.0f s",
            LOCK_WAIT_S * 1000,
            LOCK_GIVEN_UP_S,
        )
        return False

    # --- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, folder: Path, now: float, pid: int = 0) -> Board | None:
        """Map the board of ``folder`` (made if missing) and claim a slot; None, with a
        warning, where the host cannot (the process then routes on its own counts)."""
        pid = pid or os.getpid()
        fd = -1
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(folder / NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with _locked(fd):
                if os.fstat(fd).st_size != SIZE:
                    os.ftruncate(fd, 0)  # another layout's leftovers: start clean
                    os.ftruncate(fd, SIZE)
                mapped = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                if mapped[: len(MAGIC)] != MAGIC:  # new, or not a board of this layout
                    mapped[:] = bytes(SIZE)
                    _HEADER.pack_into(mapped, 0, MAGIC, SLOTS, UPSTREAMS, HOMES, 0)
                    struct.pack_into("<d", mapped, _EPOCH_AT, now)
                (epoch,) = struct.unpack_from("<d", mapped, _EPOCH_AT)
                if not math.isfinite(epoch) or epoch > now:  # damaged: the homes start over
                    struct.pack_into("<d", mapped, _EPOCH_AT, now)
                board = cls(fd, mapped, -1, pid)
                board.slot = board._claim_slot(now)
        except (OSError, ValueError) as error:
            logger.warning("routing loads are not shared with this host's peers: %s", error)
            if fd >= 0:
                os.close(fd)
            return None
        if board.slot < 0:
            logger.warning("routing loads are not shared: all %d board slots are taken", SLOTS)
            board.close()
            return None
        return board

    def _claim_slot(self, now: float) -> int:
        """A free slot (never used, its process gone, or silent past SLOT_STALE_S), zeroed and
        ours; -1 if none. Called under the lock."""
        ever = self._claimed()
        for slot in range(SLOTS):
            pid = self._slots_u32[slot * 4]
            heard = self._slots_f64[slot * 2 + 1]
            if pid and pid != self.pid and now - heard < SLOT_STALE_S and process_alive(pid):
                continue
            self._zero_slot(slot)
            self._slots_u32[slot * 4] = self.pid
            self._slots_f64[slot * 2 + 1] = now
            if slot >= ever:
                struct.pack_into("<I", self._map, _CLAIMED_AT, slot + 1)
            return slot
        return -1

    def _claimed(self) -> int:
        """How many slots have ever been claimed (the live ones are among them)."""
        claimed: int = struct.unpack_from("<I", self._map, _CLAIMED_AT)[0]
        return min(SLOTS, claimed)

    def _zero_slot(self, slot: int) -> None:
        start = _COUNTS_AT + slot * UPSTREAMS * _CELL.size
        self._map[start : start + UPSTREAMS * _CELL.size] = _ZERO_SLOT

    def close(self) -> None:
        """Give the slot back (zeroed) and unmap."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError, ValueError):
            if 0 <= self.slot < SLOTS and self._slots_u32[self.slot * 4] == self.pid:
                self._zero_slot(self.slot)
                self._slots_u32[self.slot * 4] = 0
        for view in (
            self._slots_u32,
            self._slots_f64,
            self._registry_u64,
            self._registry_f64,
            self._homes,
            self._epoch,
            self._view,
        ):
            view.release()
        self._map.close()
        os.close(self._fd)
        self._fd = -1

    # --- this process's slot ------------------------------------------------------------

    def heartbeat(self, now: float) -> None:
        """Say this process is alive; take a slot again if another process took ours while
        this one was silent (its counts are written again by the caller, ``rewrite``)."""
        if self._slots_u32[self.slot * 4] != self.pid:
            with self.locked():
                self.slot = self._claim_slot(now)
            if self.slot < 0:
                raise OSError("no board slot is free")
            return
        self._slots_f64[self.slot * 2 + 1] = now

    def owns_slot(self) -> bool:
        return self._slots_u32[self.slot * 4] == self.pid

    def write(
        self,
        column: int,
        outstanding: int,
        awaiting: int,
        pending: int,
        times: tuple[float, float],
    ) -> None:
        """This process's requests at the upstream in ``column``: outstanding, awaiting a first
        byte, the prompt bytes those bring to prefill, and ``times``: when the oldest of them
        was sent (0.0: none awaits) and when its last first byte there came."""
        if not 0 <= column < UPSTREAMS:
            return
        at = _COUNTS_AT + (self.slot * UPSTREAMS + column) * _CELL.size
        _CELL.pack_into(self._map, at, outstanding, awaiting, pending, *times)

    # --- the host -----------------------------------------------------------------------

    def live_slots(self, now: float) -> list[int]:
        """The slots whose processes have said they are alive within SLOT_STALE_S (looked at
        again at most every LIVE_EVERY_S: a process that starts is counted that much later)."""
        if now - self._live_at >= LIVE_EVERY_S or now < self._live_at:
            u32, f64 = self._slots_u32, self._slots_f64
            self._live = [
                slot
                for slot in range(self._claimed())
                if u32[slot * 4] and now - f64[slot * 2 + 1] < SLOT_STALE_S
            ]
            self._live_at = now
        return self._live

    def host(self, columns: Sequence[int], now: float, *, others: bool = False) -> HostCounts:
        """The live processes' counts for ``columns`` (-1: an upstream not on the board, all
        zeros), summed, or with ``others`` those of the processes but this one; the oldest
        send time is the earliest of theirs, the last first byte the latest."""
        n = len(columns)
        outstanding, awaiting, pending = [0] * n, [0] * n, [0] * n
        oldest, answered = [0.0] * n, [0.0] * n
        cells, unpack = self._map, _CELL.unpack_from
        places = [
            (i, _COUNTS_AT + column * _CELL.size)
            for i, column in enumerate(columns)
            if 0 <= column < UPSTREAMS
        ]
        for slot in self.live_slots(now):
            if others and slot == self.slot:
                continue
            base = slot * UPSTREAMS * _CELL.size
            for i, at in places:
                o, a, p, sent, last = unpack(cells, base + at)
                # Counts no process of ours wrote (a damaged board) are nothing there.
                if 0 <= o < MAX_COUNT and 0 <= a < MAX_COUNT and 0 <= p < MAX_PENDING:
                    outstanding[i] += o
                    awaiting[i] += a
                    pending[i] += p
                    if a and sent > 0.0 and (not oldest[i] or sent < oldest[i]):
                        oldest[i] = sent
                    answered[i] = max(answered[i], last)
        return HostCounts(outstanding, awaiting, pending, oldest, answered)

    # --- the registry -------------------------------------------------------------------

    def columns(self, upstream_ids: Sequence[str], now: float) -> dict[str, int]:
        """The column of each upstream id (registered if new; -1 where the registry has no
        room), each marked used now."""
        found: dict[str, int] = {}
        missing: list[tuple[str, int]] = []
        for uid in upstream_ids:
            key = id_hash(uid)
            column = self._find(key)
            if column < 0:
                missing.append((uid, key))
            else:
                found[uid] = column
                self._registry_f64[column * 2 + 1] = now
        if missing:
            with self.locked():
                for uid, key in missing:
                    found[uid] = self._register(key, now)
        return found

    def _probe(self, key: int) -> Iterator[int]:
        start = key % UPSTREAMS
        for step in range(REGISTRY_PROBES):
            yield (start + step) % UPSTREAMS

    def _find(self, key: int) -> int:
        for column in self._probe(key):
            held = self._registry_u64[column * 2]
            if held == key:
                return column
            if held == 0:
                return -1
        return -1

    def _register(self, key: int, now: float) -> int:
        """Under the lock: the key's column, taking an empty entry or one idle past
        REGISTRY_IDLE_S whose counts are all zero; -1 if none is free."""
        reusable = -1
        for column in self._probe(key):
            held = self._registry_u64[column * 2]
            if held == key:
                return column
            if held == 0:
                reusable = column
                break
            # Not "used within REGISTRY_IDLE_S": a time that is no number is idle too.
            idle = not now - self._registry_f64[column * 2 + 1] < REGISTRY_IDLE_S
            if reusable < 0 and idle and self._column_is_idle(column):
                reusable = column
        if reusable < 0:
            return -1
        for slot in range(SLOTS):  # what the upstream before it left
            at = _COUNTS_AT + (slot * UPSTREAMS + reusable) * _CELL.size
            self._map[at : at + _CELL.size] = _ZERO_SLOT[: _CELL.size]
        self._registry_f64[reusable * 2 + 1] = now
        self._registry_u64[reusable * 2] = key
        return reusable

    def _column_is_idle(self, column: int) -> bool:
        for slot in range(SLOTS):
            o, a, *_ = _CELL.unpack_from(
                self._map, _COUNTS_AT + (slot * UPSTREAMS + column) * _CELL.size
            )
            if o or a:
                return False
        return True

    # --- homes --------------------------------------------------------------------------

    def _tenths(self, now: float) -> int:
        """``now`` in tenths of a second since the board was made (a home's time)."""
        tenths = (now - self._epoch[0]) * 10
        return max(0, min(0xFFFFFFFF, int(tenths))) if math.isfinite(tenths) else 0

    def home(self, keys: Sequence[int], now: float) -> tuple[int, int] | None:
        """Where a fresh home says the prompt of ``keys`` was placed: its column and how many
        of the leading keys were placed there, if its first key has one."""
        since = self._tenths(now)
        found = self._fresh(keys[0], since) if keys else None
        if found is None:
            return None
        column = found[1]
        depth = 1
        for key in keys[1:HOME_KEYS]:
            held = self._fresh(key, since)
            if held is None or held[1] != column:
                break
            depth += 1
        return column, depth

    def claim_home(self, keys: Sequence[int], column: int, now: float) -> int:
        """Make ``column`` the home of the prompt of ``keys`` (its first ``HOME_KEYS``) unless a
        fresh home of its first key names another: the column of the home that stands (under
        the lock, so of two processes claiming at the same instant one wins and both learn
        which)."""
        since = self._tenths(now)
        with self.locked():
            found = self._fresh(keys[0], since)
            if found is not None:
                return found[1]
            for key in keys[:HOME_KEYS]:
                self._write_home(key, column, since)
        return column

    def _fresh(self, key: int, since: int) -> tuple[int, int] | None:
        """The entry index and column of ``key``'s fresh home, if it has one."""
        start = key % HOMES
        for step in range(HOME_PROBES):
            index = (start + step) % HOMES
            held, column, when = _HOME.unpack_from(self._homes, index * _HOME.size)
            if held == key:
                if since - when <= HOME_TTL_TENTHS and 0 <= column < UPSTREAMS:
                    return index, column
                return None
        return None

    def _write_home(self, key: int, column: int, since: int) -> None:
        """Under the lock: ``key``'s home is ``column`` from ``since``, in its own entry or the
        probe window's emptiest or oldest."""
        start = key % HOMES
        victim, victim_when = start, 1 << 40
        for step in range(HOME_PROBES):
            index = (start + step) % HOMES
            held, _, when = _HOME.unpack_from(self._homes, index * _HOME.size)
            if held == key:
                victim = index
                break
            age = when if held and since - when <= HOME_TTL_TENTHS else -1  # free ones first
            if age < victim_when:
                victim, victim_when = index, age
        # The key last, so a reader that sees it sees the column written with it.
        at = victim * _HOME.size
        struct.pack_into("<H2xI", self._homes, at + 8, column, since)
        struct.pack_into("<Q", self._homes, at, key)


_ZERO_SLOT = bytes(UPSTREAMS * _CELL.size)


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    """The lock for opening the board (claiming a slot): an ``OSError`` where it is not to be
    had within ``OPEN_LOCK_WAIT_S`` (the process then routes on its own counts, but starts)."""
    if not _acquire(fd, OPEN_LOCK_WAIT_S):
        raise OSError(f"the board stayed locked for {OPEN_LOCK_WAIT_S:.0f} s")
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _acquire(fd: int, wait_s: float) -> bool:
    """Take ``fd``'s exclusive ``flock``, trying again (at growing intervals, up to a
    millisecond) for ``wait_s`` at most; False where it could not. ``flock`` itself has no
    timeout, and a blocked one would block the event loop for as long as the holder keeps it."""
    deadline = time.monotonic() + wait_s
    pause = 0.00005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(pause)
        pause = min(pause * 2, 0.001)


def process_alive(pid: int) -> bool:
    """Whether a process has ``pid`` (one we may not signal is alive)."""
    if not 0 < pid <= MAX_PID:  # no process has it (a damaged slot's pid)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
