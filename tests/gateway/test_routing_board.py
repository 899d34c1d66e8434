"""The host's board (``gateway.routing.board``): loads and new prefixes' homes shared by the web
processes of one host through one mapped file, read from hostile bytes too; and what a process
reads of it (``gateway.routing.loads``): the prefill each upstream has queued."""

from __future__ import annotations

import multiprocessing
import os
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.routing import board as board_module
from gateway.routing.board import (
    HOME_TTL_S,
    NAME,
    REGISTRY_IDLE_S,
    SIZE,
    SLOT_STALE_S,
    SLOTS,
    Board,
)
from gateway.routing.loads import DEFAULT_PREFILL_RATE, PEERS_FRESH_S, Loads, PrefillRate
from tests.harness.stopped import stopped_holding_flock

NOW = 10_000.0


def open_board(folder: Path, pid: int, now: float = NOW) -> Board:
    board = Board.open(folder, now, pid=pid)
    assert board is not None
    return board


def live_pid() -> int:
    return os.getppid()  # alive for as long as the test runs, and not this process


def test_two_processes_read_each_others_loads_the_moment_they_are_written(tmp_path: Path) -> None:
    a = open_board(tmp_path, os.getpid())
    b = open_board(tmp_path, live_pid())
    try:
        assert a.slot != b.slot
        cols_a = a.columns(["replica:1", "replica:2"], NOW)
        cols_b = b.columns(["replica:2", "replica:1", "replica:3"], NOW)
        assert cols_a["replica:1"] == cols_b["replica:1"]  # one upstream, one column
        a.write(cols_a["replica:1"], 3, 2, 5000, (NOW - 0.5, NOW - 0.1))
        b.write(cols_b["replica:1"], 1, 1, 700, (NOW - 0.2, NOW - 0.3))
        seen = b.host([cols_b["replica:1"], cols_b["replica:3"], -1], NOW)
        assert seen.outstanding == [4, 0, 0]
        assert seen.awaiting == [3, 0, 0]
        assert seen.pending == [5700, 0, 0]
        assert seen.oldest == [NOW - 0.5, 0.0, 0.0]  # the earliest of theirs
        assert seen.answered == [NOW - 0.1, 0.0, 0.0]  # the latest
    finally:
        a.close()
        b.close()


def test_a_silent_process_counts_for_nothing_and_its_slot_is_taken_over_zeroed(
    tmp_path: Path,
) -> None:
    silent = open_board(tmp_path, live_pid())
    column = silent.columns(["replica:1"], NOW)["replica:1"]
    silent.write(column, 7, 7, 9999, (0.0, 0.0))
    reader = open_board(tmp_path, os.getpid())
    try:
        assert reader.host([column], NOW).outstanding == [7]
        # Not heard from for SLOT_STALE_S: skipped, whatever it last wrote.
        assert reader.host([column], NOW + SLOT_STALE_S + 1).outstanding == [0]
        # A process starting now takes the silent one's slot, and starts from zero there.
        reader.heartbeat(NOW + SLOT_STALE_S + 1)
        late = open_board(tmp_path, 1, now=NOW + SLOT_STALE_S + 1)  # pid 1: always alive
        assert late.slot == silent.slot
        assert reader.host([column], NOW + SLOT_STALE_S + 1).outstanding == [0]
        # The silent one takes another slot when it next says it is alive.
        assert not silent.owns_slot()
        silent.heartbeat(NOW + SLOT_STALE_S + 2)
        assert silent.owns_slot() and silent.slot not in (late.slot, reader.slot)
        late.close()
    finally:
        reader.close()
        silent.close()


def test_a_dead_process_slot_is_taken_over_at_once(tmp_path: Path) -> None:
    dead = open_board(tmp_path, (1 << 22) + 1)  # past the largest pid Linux allows: never alive
    column = dead.columns(["replica:1"], NOW)["replica:1"]
    dead.write(column, 7, 7, 9999, (0.0, 0.0))
    new = open_board(tmp_path, os.getpid())
    try:
        assert new.slot == dead.slot
        assert new.host([column], NOW).outstanding == [0]
    finally:
        new.close()
        dead.close()


def test_a_closed_process_gives_its_slot_back_empty(tmp_path: Path) -> None:
    a = open_board(tmp_path, os.getpid())
    column = a.columns(["replica:1"], NOW)["replica:1"]
    a.write(column, 2, 1, 100, (0.0, 0.0))
    b = open_board(tmp_path, live_pid())
    a.close()
    try:
        assert b.host([column], NOW).outstanding == [0]
    finally:
        b.close()


def colliding_ids(count: int) -> list[str]:
    """Upstream ids whose registry entries all start at one place: one probe window."""
    found: dict[int, list[str]] = {}
    for i in range(1_000_000):
        uid = f"replica:{i}"
        group = found.setdefault(board_module.id_hash(uid) % board_module.UPSTREAMS, [])
        group.append(uid)
        if len(group) == count:
            return group
    raise AssertionError("no such ids")


def test_a_registry_entry_goes_to_another_upstream_only_when_long_unused_and_idle(
    tmp_path: Path,
) -> None:
    *window, extra = colliding_ids(board_module.REGISTRY_PROBES + 1)
    b = open_board(tmp_path, os.getpid())
    try:
        old = b.columns(window, NOW)
        assert len(set(old.values())) == len(window) and -1 not in old.values()
        assert b.columns([extra], NOW + 1)[extra] == -1  # no room: counted by its process alone
        b.write(old[window[0]], 1, 0, 0, (0.0, 0.0))  # the first still has a request outstanding
        later = NOW + REGISTRY_IDLE_S + 1
        b.columns(window[1:3], later)  # two are still routed to
        taken = b.columns([extra], later)[extra]
        assert taken in [old[u] for u in window[3:]]  # long unused and empty: reusable
        assert b.host([taken], later).outstanding == [0]
    finally:
        b.close()


def test_one_new_prefix_has_one_home_whoever_claims_it(tmp_path: Path) -> None:
    a = open_board(tmp_path, os.getpid())
    b = open_board(tmp_path, live_pid())
    try:
        prompt = (42, 43, 44, 45)
        assert a.home(prompt, NOW) is None
        assert a.claim_home(prompt, column=3, now=NOW) == 3
        assert b.claim_home(prompt, column=1, now=NOW + 0.001) == 3  # it follows a's
        assert b.home(prompt, NOW + 1) == (3, 4)
        # Another prompt opening the same way is placed there as far as their blocks agree.
        assert b.home((42, 43, 99, 100), NOW + 1) == (3, 2)
        assert b.home((41, 43), NOW + 1) is None  # its first block differs: a new prompt
        # Past its time a home is no longer trusted, and a new placement replaces it.
        assert b.home(prompt, NOW + HOME_TTL_S + 1) is None
        assert b.claim_home(prompt, column=1, now=NOW + HOME_TTL_S + 1) == 1
        assert a.home(prompt, NOW + HOME_TTL_S + 2) == (1, 4)
    finally:
        a.close()
        b.close()


def test_a_home_covers_a_placements_first_blocks_only(tmp_path: Path) -> None:
    b = open_board(tmp_path, os.getpid())
    try:
        prompt = tuple(range(1000, 1000 + board_module.HOME_KEYS + 10))
        b.claim_home(prompt, column=2, now=NOW)
        assert b.home(prompt, NOW) == (2, board_module.HOME_KEYS)
    finally:
        b.close()


def test_homes_make_room_for_new_prefixes_by_dropping_the_oldest(tmp_path: Path) -> None:
    b = open_board(tmp_path, os.getpid())
    try:
        homes = board_module.HOMES
        keys = [7 + homes * i for i in range(board_module.HOME_PROBES + 1)]  # one probe window
        for i, key in enumerate(keys):
            assert b.claim_home((key,), column=i, now=NOW + i) == i
        assert b.home((keys[0],), NOW + 10) is None  # the oldest made room
        assert all(b.home((k,), NOW + 10) is not None for k in keys[1:])
    finally:
        b.close()


def _claim_at_once(folder: str, column: int, keys: list[int], start: Any, out: Any) -> None:
    board = Board.open(Path(folder), NOW)
    assert board is not None
    start.wait()
    out.put([board.claim_home((key, key + 1_000_000), column, NOW) for key in keys])
    board.close()


def test_two_processes_claiming_the_same_new_prefixes_at_the_same_instant_agree(
    tmp_path: Path,
) -> None:
    """Real processes, released by one barrier, each claiming the same 500 new prefixes for an
    upstream of its own: every prefix ends with one home, and both were told the same one."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    out = context.Queue()
    keys = list(range(1, 501))
    procs = [
        context.Process(target=_claim_at_once, args=(str(tmp_path), column, keys, start, out))
        for column in (1, 2)
    ]
    for proc in procs:
        proc.start()
    told = [out.get(timeout=60), out.get(timeout=60)]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert told[0] == told[1]
    reader = open_board(tmp_path, os.getpid())
    try:
        homes = [reader.home((k, k + 1_000_000), NOW) for k in keys]
        assert homes == [(column, 2) for column in told[0]]
    finally:
        reader.close()


def test_a_process_stopped_holding_the_lock_does_not_stop_the_others_placements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = Loads()
    loads.share(open_board(tmp_path, os.getpid()))
    board = loads.board
    assert board is not None
    loads.remember({"r1": 1, "r2": 1}, NOW)
    tries: list[float] = []
    acquire = board_module._acquire

    def counted(fd: int, wait: float) -> bool:
        tries.append(wait)
        return acquire(fd, wait)

    monkeypatch.setattr(board_module, "_acquire", counted)
    try:
        with stopped_holding_flock(tmp_path / NAME):
            # The placement goes on without the lock, reading the host's loads as placing does.
            with board.locked():
                assert board.is_locked()
                held = loads.acquire("r1", 1_000, NOW)
                assert loads.host_outstanding(["r1", "r2"], NOW) == {"r1": 1, "r2": 0}
            assert not board.is_locked()
            assert len(tries) == 1
            # The next placements do not wait for it again for a while: one wait, not one each.
            for _ in range(3):
                with board.locked():
                    assert board.claim_home((7, 8), column=1, now=NOW) == 1
            assert len(tries) == 1
            loads.release(held)
        # The holder has let go (it ran again and ended): placements hold the lock again.
        monkeypatch.setattr(board, "_given_up_until", 0.0)
        with board.locked():
            assert board._holds
        assert len(tries) == 2
    finally:
        loads.unshare()


def test_a_process_starting_while_a_stopped_one_holds_the_lock_starts_on_its_own_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    open_board(tmp_path, live_pid()).close()  # the board's file, as a web process makes it
    with stopped_holding_flock(tmp_path / NAME):
        assert Board.open(tmp_path, NOW, pid=os.getpid()) is None
    assert "routing loads are not shared" in caplog.text
    open_board(tmp_path, os.getpid()).close()  # and once it has let go, shares them


@pytest.mark.parametrize(
    "damage",
    [
        b"",  # empty: a board of another size is made anew
        b"\xff" * SIZE,  # every byte set: counts no process could write, columns past the end
        os.urandom(SIZE),
        b"LLMGWBD0" + bytes(SIZE - 8),  # another layout's header
        # This layout's header over garbage (damaged after it was made): read defensively.
        board_module.MAGIC + b"\xff" * (SIZE - 8),
        board_module.MAGIC + os.urandom(SIZE - 8),
    ],
)
def test_a_damaged_board_is_read_as_nothing_there_never_as_a_failure(
    tmp_path: Path, damage: bytes
) -> None:
    (tmp_path / board_module.NAME).write_bytes(damage)
    b = open_board(tmp_path, os.getpid())
    try:
        column = b.columns(["replica:1"], NOW)["replica:1"]
        counts = b.host([column], NOW)
        assert all(0 <= c < board_module.MAX_COUNT for c in counts.outstanding + counts.awaiting)
        found = b.home((12345, 6789), NOW)
        assert found is None or 0 <= found[0] < board_module.UPSTREAMS
        b.write(column, 1, 1, 10, (0.0, 0.0))
        assert b.host([column], NOW).outstanding[0] in (0, 1)  # 0: no room left for it
    finally:
        b.close()


def test_every_slot_taken_leaves_a_process_to_route_on_its_own_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(board_module, "process_alive", lambda pid: True)
    boards = [open_board(tmp_path, 100_000 + n) for n in range(SLOTS)]
    try:
        assert Board.open(tmp_path, NOW, pid=os.getpid()) is None
    finally:
        for b in boards:
            b.close()


def test_a_board_that_cannot_be_made_leaves_routing_alone(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the folder would be")
    assert Board.open(blocked, NOW) is None


# --------------------------------------------------------------------------- the prefill queue


def test_a_prefill_rate_is_the_inverse_slope_of_time_to_first_byte_over_bytes() -> None:
    rate = PrefillRate()
    assert rate.value is None
    jitter = random.Random(5)
    for size in (20, 30, 25, 60) * 5:  # a few words each: their first bytes are fixed costs
        rate.learn(size, 0.003 + jitter.uniform(-0.001, 0.001) + size / 60_000)
    assert rate.value is None, "tiny prompts say nothing of how fast the engine prefills"
    for size in (5_000, 9_000, 200, 12_000, 3_000) * 4:
        rate.learn(size, 0.003 + size / 60_000)
    assert rate.value == pytest.approx(60_000, rel=0.01)
    one_size = PrefillRate()
    for _ in range(10):
        one_size.learn(8_000, 0.1)
    assert one_size.value == pytest.approx(80_000)
    one_size.learn(-5, 0.1)  # nothing to learn from
    one_size.learn(100, 0.0)
    one_size.learn(100, 3600.0)
    assert one_size.value == pytest.approx(80_000)


def test_the_wait_at_an_upstream_is_its_queued_prefill_less_what_it_has_done() -> None:
    loads = Loads()
    rate = loads.rates["r1"] = PrefillRate()
    for size in (1_000, 5_000, 9_000) * 3:
        rate.learn(size, size / 50_000)
    first = loads.acquire("r1", 5_000, NOW)
    second = loads.acquire("r1", 5_000, NOW + 0.01)
    assert second.ahead == pytest.approx(5_000 - 500)  # 10 ms of the first done
    assert loads.backlog("r1", NOW + 0.01) == pytest.approx(10_000 - 500)
    waits = loads.first_tokens(["r1", "r2"], NOW + 0.05, 0)
    assert waits["r1"] == pytest.approx((10_000 - 2_500) / 50_000)
    assert waits["r2"] == 0.0
    # A prompt's own part, less what is cached where, at the mean rate.
    waits = loads.first_tokens(["r1", "r2"], NOW + 0.05, 5_000, {"r2": 4_000})
    assert waits["r2"] == pytest.approx(1_000 / 50_000)
    # The first's first byte: the engine began on the second then, not when it was sent.
    loads.answered(first, NOW + 0.1)
    waits = loads.first_tokens(["r1"], NOW + 0.11, 0)
    assert waits["r1"] == pytest.approx((5_000 - 500) / 50_000, rel=0.01)
    loads.release(first)
    loads.release(second)  # ended without a first byte (a failure): its queue goes too
    assert loads.first_tokens(["r1"], NOW + 0.3, 0)["r1"] == 0.0
    assert loads.host_outstanding(["r1"], NOW + 0.3).get("r1", 0) == 0
    assert loads.awaiting == {} and loads.pending == {}


def test_the_host_processes_see_each_others_queues_through_the_board(tmp_path: Path) -> None:
    own, peer = Loads(), Loads()
    own.share(open_board(tmp_path, os.getpid()))
    peer.share(open_board(tmp_path, live_pid()))
    try:
        own.remember({"r1": 1, "r2": 1}, NOW)
        peer.remember({"r2": 1, "r1": 1}, NOW)
        held = peer.acquire("r1", 8_000, NOW)
        assert own.host_outstanding(["r1", "r2"], NOW) == {"r1": 1, "r2": 0}
        waits = own.first_tokens(["r1", "r2"], NOW, 0)
        assert waits["r1"] > waits["r2"] == 0.0
        mine = own.acquire("r1", 2_000, NOW)
        assert mine.ahead == pytest.approx(8_000)  # sent behind the peer's
        assert own.host_outstanding(["r1"], NOW) == {"r1": 2}  # its own, at once
        peer.release(held)
        # The others' counts are read again once PEERS_FRESH_S has passed (or at once under
        # the board's lock, where a new prompt is placed).
        assert own.host_outstanding(["r1"], NOW + 0.001) == {"r1": 2}
        assert own.host_outstanding(["r1"], NOW + PEERS_FRESH_S) == {"r1": 1}
        peer.acquire("r1", 1_000, NOW + PEERS_FRESH_S)
        board = own.board
        assert board is not None
        with board.locked():
            assert own.host_outstanding(["r1"], NOW + PEERS_FRESH_S) == {"r1": 2}
            # A request held under the lock is queued behind what the board says now: its
            # own 2,000 bytes and the peer's new 1,000, less 2 ms of the oldest done at the
            # rate assumed before any first byte.
            done = PEERS_FRESH_S * DEFAULT_PREFILL_RATE
            assert own.backlog("r1", NOW + PEERS_FRESH_S) == pytest.approx(3_000 - done)
        own.release(mine)
        assert own.host_outstanding(["r1"], NOW + PEERS_FRESH_S) == {"r1": 1}
    finally:
        own.unshare()
        peer.unshare()


def test_a_restarted_replica_is_a_new_upstream_on_the_board(tmp_path: Path) -> None:
    loads = Loads()
    loads.share(open_board(tmp_path, os.getpid()))
    try:
        loads.remember({"replica:3": 1}, NOW)
        before = loads.column("replica:3")
        loads.remember({"replica:3": 2}, NOW + 1)  # a new generation
        after = loads.column("replica:3")
        assert before is not None and after is not None and before != after
        assert loads.columns_by_upstream() == {after: "replica:3"}
    finally:
        loads.unshare()


def test_a_process_whose_slot_was_taken_over_writes_its_counts_again(tmp_path: Path) -> None:
    loads = Loads()
    loads.share(open_board(tmp_path, os.getpid()))
    try:
        loads.remember({"r1": 1}, NOW)
        loads.acquire("r1", 1_000, NOW)
        board = loads.board
        assert board is not None
        # Silent for too long: another process took the slot over, zeroed.
        later = NOW + SLOT_STALE_S + 1
        other = open_board(tmp_path, 1, now=later)  # pid 1: always alive
        assert other.slot == board.slot
        loads.heartbeat(later)
        assert board.slot != other.slot
        reader = open_board(tmp_path, live_pid(), now=later)
        try:
            column = reader.columns(["r1@1"], later)["r1@1"]
            assert reader.host([column], later).outstanding == [1]
        finally:
            reader.close()
            other.close()
    finally:
        loads.unshare()


def test_at_an_idle_fleet_only_what_is_cached_sets_the_upstreams_apart() -> None:
    """Learned rates differ a little by chance; with nothing queued, a prompt's first token
    is priced alike everywhere but for what is cached where, so the order every process
    agrees on decides, not the noise in each one's rates."""
    loads = Loads()
    for uid, rate in (("r1", 50_000), ("r2", 55_000), ("r3", 47_000)):
        learned = loads.rates[uid] = PrefillRate()
        for size in (2_000, 9_000, 4_000) * 3:
            learned.learn(size, size / rate)
        loads.answered(loads.acquire(uid, 0, NOW), NOW)  # a first byte: the mean is known
    starts = loads.first_tokens(["r1", "r2", "r3"], NOW, 8_000)
    assert starts["r1"] == starts["r2"] == starts["r3"]
    starts = loads.first_tokens(["r1", "r2", "r3"], NOW, 8_000, {"r3": 4_000})
    assert starts["r3"] < starts["r1"] == starts["r2"]
    # A queue drains at its upstream's own rate.
    loads.acquire("r2", 6_000, NOW)
    starts = loads.first_tokens(["r1", "r2"], NOW + 0.01, 8_000)
    assert starts["r2"] - starts["r1"] == pytest.approx((6_000 - 550) / 55_000, rel=0.02)


def test_what_is_learned_of_an_upstream_goes_with_it() -> None:
    loads = Loads()
    for uid in ("r1", "r2", "r3"):
        hold = loads.acquire(uid, 5_000, NOW)
        loads.answered(hold, NOW + 0.1)
        if uid != "r3":
            loads.release(hold)  # r3 still holds a request
    loads.keep(["r1"])  # r2 left the table, r3 too but a request is still held there
    assert set(loads.rates) == {"r1", "r3"}
    assert loads.rate("r2") == loads.rate("r1")  # a stranger gets the mean of the known ones
