"""The placements a host's web processes tell each other (``gateway.routing.peers``): the
datagram as parsed from hostile bytes, and two real ends exchanging over their sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.routing import peers
from gateway.routing.peers import Peers, decode, encode

KEY = st.integers(min_value=0, max_value=(1 << 64) - 1)


@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=20), st.lists(KEY, max_size=40).map(tuple)),
        max_size=20,
    ),
)
def test_what_is_encoded_decodes_to_the_same(placements: list[tuple[str, tuple[int, ...]]]) -> None:
    got: list[tuple[str, tuple[int, ...]]] = []
    for data in encode(1234, placements):
        assert len(data) <= peers.MAX_DATAGRAM
        pid, part = decode(data)
        assert pid == 1234
        got += part
    assert got == placements


def test_a_large_batch_goes_as_several_datagrams_each_under_the_limit() -> None:
    keys = tuple(range(peers.MAX_KEYS + 100))  # cut to MAX_KEYS
    datagrams = list(encode(7, [("replica:1", keys)] * 20))
    assert len(datagrams) > 1
    placements = [p for d in datagrams for p in decode(d)[1]]
    assert len(placements) == 20
    assert all(k == keys[: peers.MAX_KEYS] for _, k in placements)


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_are_refused_as_a_whole(data: bytes) -> None:
    for candidate in (data, peers.MAGIC + data):
        # Anything else (an IndexError, a MemoryError for a count it believed) is a defect.
        with contextlib.suppress(ValueError, UnicodeDecodeError, struct.error):
            decode(candidate)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"LGP2" + b"\0" * 10,  # another version
        peers.MAGIC + b"\1\0",  # a header cut short
        peers.MAGIC + struct.pack("<I", 1) + struct.pack("<H", 0),  # an empty id
        peers.MAGIC + struct.pack("<I", 1) + struct.pack("<H", 600) + b"x" * 600,
        peers.MAGIC + struct.pack("<I", 1) + struct.pack("<H", 1) + b"a" + b"\xff\xff",
        peers.MAGIC + struct.pack("<I", 1) + struct.pack("<H", 2) + b"\xff\xfe\0\0",
        peers.MAGIC + struct.pack("<I", 1) + struct.pack("<H", 1) + b"a",  # no key count
    ],
)
def test_a_malformed_datagram_is_refused(data: bytes) -> None:
    with pytest.raises((ValueError, UnicodeDecodeError, struct.error)):
        decode(data)


async def test_two_ends_tell_each_other_placements(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    held: dict[int, list[tuple[str, tuple[int, ...]]]] = {1: [], 2: []}
    # A deep folder: a Unix socket's own path could not be this long.
    folder = tmp_path / ("x" * 60) / ("y" * 60) / "routing-peers"
    a = Peers(folder, lambda u, k: held[1].append((u, k)), pid=os.getpid())
    b = Peers(folder, lambda u, k: held[2].append((u, k)), pid=_pid_that_is_alive())
    try:
        assert a.start(loop)
        assert b.start(loop)  # says hello: a knows of b before a looks at the folder again
        await _turns(loop, lambda: a._peers == [f"{b.pid}.sock"])
        a.tell("replica:1", (11, 22, 33))
        a.tell("replica:2", (44,))
        await _turns(loop, lambda: len(held[2]) == 2)
        assert held[2] == [("replica:1", (11, 22, 33)), ("replica:2", (44,))]
        assert held[1] == []  # nobody tells itself

        # A malformed datagram is dropped and counted; the exchange goes on.
        b._sock.sendto(b"garbage", a._path(f"{a.pid}.sock"))  # type: ignore[union-attr]
        await _turns(loop, lambda: a.dropped == 1)

        # b stops: a's next send finds its socket gone and forgets it.
        b.close()
        a.tell("replica:2", (44,))
        await _turns(loop, lambda: not a._peers)
    finally:
        a.close()
        b.close()
    assert not list(folder.iterdir())  # each end took its socket along


def test_a_socket_left_by_a_process_that_is_gone_is_cleared(tmp_path: Path) -> None:
    folder = tmp_path / "routing-peers"
    folder.mkdir()
    gone = _pid_that_is_gone()
    (folder / f"{gone}.sock").touch()
    end = Peers(folder, lambda u, k: None)
    loop = asyncio.new_event_loop()
    try:
        assert end.start(loop)
        assert end._peers == []
        assert not (folder / f"{gone}.sock").exists()
    finally:
        end.close()
        loop.close()


async def _turns(loop: asyncio.AbstractEventLoop, done: Callable[[], bool]) -> None:
    for _ in range(200):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 200 turns of the loop")


def _pid_that_is_alive() -> int:
    return os.getppid()


def _pid_that_is_gone() -> int:
    return 4_194_305  # past the largest pid_max Linux allows: never a process
