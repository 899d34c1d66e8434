"""The lease's contract, on whichever backend the suite runs against (SQLite and PostgreSQL).

Time passes in these tests without sleeping: a claim with a zero TTL expires at once on the
database's clock, and the holder's own deadline runs on an injected clock.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import DatabaseError, connection

from control import leases
from control.models import Event
from tests.harness.clock import FakeClock, SteppingClock
from tests.harness.procs import REPO_ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("election_on")]


def write_event(message: str) -> None:
    Event.objects.create(kind=Event.Kind.LEADERSHIP, subject="test", message=message)


def test_first_claim_wins_with_epoch_one() -> None:
    result = leases.claim(owner="a")
    assert result.is_leader
    assert result.epoch == 1
    view = leases.read()
    assert view is not None
    assert (view.owner, view.epoch) == ("a", 1)
    assert 9.0 < view.expires_in <= 10.0


def test_holder_renews_and_keeps_its_epoch() -> None:
    first = leases.claim(owner="a", ttl=5)
    assert leases.read() is not None
    renewed = leases.claim(owner="a", previous=first, ttl=60)
    assert renewed.is_leader
    assert renewed.epoch == first.epoch == 1
    view = leases.read()
    assert view is not None and view.expires_in > 50


def test_second_owner_cannot_take_a_live_lease() -> None:
    leases.claim(owner="a")
    other = leases.claim(owner="b")
    assert not other.is_leader
    view = leases.read()
    assert view is not None and (view.owner, view.epoch) == ("a", 1)


def test_second_owner_takes_an_expired_lease_with_the_next_epoch() -> None:
    leases.claim(owner="a", ttl=0)  # expires at once on the database clock
    taken = leases.claim(owner="b")
    assert taken.is_leader
    assert taken.epoch == 2
    view = leases.read()
    assert view is not None and view.owner == "b"


def test_old_owner_renew_fails_after_another_owner_took_over() -> None:
    old = leases.claim(owner="a", ttl=0)
    leases.claim(owner="b")
    renewed = leases.claim(owner="a", previous=old)
    assert not renewed.is_leader
    assert not renewed.may_act()
    view = leases.read()
    assert view is not None and (view.owner, view.epoch) == ("b", 2)


def test_epoch_never_goes_down_across_many_changes_of_owner() -> None:
    epochs = []
    for turn in range(10):
        result = leases.claim(owner=f"owner-{turn % 3}", ttl=0)
        assert result.is_leader
        epochs.append(result.epoch)
    assert epochs == list(range(1, 11))


def test_release_lets_another_owner_take_at_once() -> None:
    held = leases.claim(owner="a", ttl=60)
    assert leases.release(held)
    taken = leases.claim(owner="b", ttl=60)
    assert taken.is_leader
    assert taken.epoch == 2


def test_release_by_a_deposed_owner_changes_nothing() -> None:
    old = leases.claim(owner="a", ttl=0)
    leases.claim(owner="b", ttl=60)
    assert not leases.release(old)
    view = leases.read()
    assert view is not None and view.owner == "b" and view.held


def test_store_error_keeps_the_claim_until_its_own_deadline(
    fake_clock: FakeClock, store_unreachable: None
) -> None:
    held = leases.Leadership("reconciler", "a", epoch=3, is_leader=True, act_until=fake_clock() + 6)
    kept = leases.claim(owner="a", previous=held, clock=fake_clock)
    assert kept.is_leader and kept.epoch == 3
    assert kept.store_error
    assert kept.may_act(fake_clock)
    fake_clock.advance(6.01)
    again = leases.claim(owner="a", previous=kept, clock=fake_clock)
    assert again.is_leader and not again.may_act(fake_clock)


def test_store_error_without_a_claim_means_follower(store_unreachable: None) -> None:
    result = leases.claim(owner="a")
    assert not result.is_leader
    assert result.store_error


def test_claim_works_again_once_the_store_returns(fake_clock: FakeClock) -> None:
    held = leases.claim(owner="a", clock=fake_clock)
    connection.close()
    saved = connection.settings_dict.get("PORT"), connection.settings_dict["NAME"]
    try:
        if connection.vendor == "postgresql":
            connection.settings_dict["PORT"] = "1"
        else:
            connection.settings_dict["NAME"] = "/nonexistent-llmgw-dir/store.sqlite3"
        kept = leases.claim(owner="a", previous=held, clock=fake_clock)
        assert kept.store_error
    finally:
        connection.close()
        connection.settings_dict["PORT"], connection.settings_dict["NAME"] = saved
    renewed = leases.claim(owner="a", previous=kept, clock=fake_clock)
    assert renewed.is_leader and not renewed.store_error and renewed.epoch == held.epoch


def test_holder_may_act_only_until_the_renew_deadline(fake_clock: FakeClock) -> None:
    held = leases.claim(owner="a", renew_deadline=6, clock=fake_clock)
    assert held.may_act(fake_clock)
    fake_clock.advance(5.9)
    assert held.may_act(fake_clock)
    fake_clock.advance(0.2)
    assert not held.may_act(fake_clock)


def test_a_claim_answered_past_the_renew_deadline_is_not_acted_on_nor_renewed() -> None:
    """[L17] A store so slow that the renewal lands but its answer comes past the deadline:
    the holder does not act, and its next claims leave the row to expire for a standby."""
    held = leases.claim(owner="a", ttl=60)
    slow = SteppingClock(step=7)
    late = leases.claim(owner="a", previous=held, ttl=60, clock=slow)
    assert late.is_leader and late.epoch == held.epoch
    # Asked on the claim's own clock: its times are that clock's, not this machine's (a
    # machine up for less than the stepping clock's start once saw them still ahead).
    assert not late.may_act(slow) and not late.may_renew
    expiry = leases.read()
    again = leases.claim(owner="a", previous=late, ttl=60)
    assert not again.is_leader and not again.may_renew
    view = leases.read()
    assert view is not None and expiry is not None
    assert view.owner == "a" and view.expires_in <= expiry.expires_in, "not renewed"
    assert not leases.claim(owner="b").is_leader  # the row keeps its claim until it expires


def test_a_holder_that_stopped_renewing_renews_again_once_answered_in_time() -> None:
    late = leases.claim(owner="a", ttl=0, clock=SteppingClock(step=7))  # expired at once
    assert not late.may_renew
    taken = leases.claim(owner="a", previous=late, ttl=60)  # an expired lease may be taken
    assert taken.may_act() and taken.may_renew and taken.epoch == late.epoch
    renewed = leases.claim(owner="a", previous=taken, ttl=60)
    assert renewed.may_act() and renewed.epoch == taken.epoch


def test_fenced_write_by_the_live_holder_is_kept() -> None:
    held = leases.claim(owner="a")
    with leases.fenced(held):
        write_event("kept")
    assert Event.objects.filter(message="kept").count() == 1


def test_fenced_write_by_a_deposed_owner_changes_no_row() -> None:
    old = leases.claim(owner="a", ttl=0)
    leases.claim(owner="b")
    with pytest.raises(leases.LeadershipLost), leases.fenced(old):
        write_event("stale")
    assert not Event.objects.filter(message="stale").exists()


def test_fenced_write_after_the_lease_expired_changes_no_row() -> None:
    # Nobody took over yet, but the row has expired: the holder must not act on it.
    old = leases.claim(owner="a", ttl=0, renew_deadline=60)
    with pytest.raises(leases.LeadershipLost), leases.fenced(old):
        write_event("stale")
    assert not Event.objects.exists()


def test_fenced_block_past_its_local_deadline_does_not_touch_the_store(
    fake_clock: FakeClock,
) -> None:
    held = leases.claim(owner="a", renew_deadline=6, clock=fake_clock)
    fake_clock.advance(7)
    with pytest.raises(leases.LeadershipLost), leases.fenced(held, clock=fake_clock):
        write_event("late")
    assert not Event.objects.exists()


def test_writes_inside_a_fence_roll_back_when_the_block_fails() -> None:
    held = leases.claim(owner="a")
    with pytest.raises(RuntimeError), leases.fenced(held):
        write_event("half")
        raise RuntimeError("tick failed half-way")
    assert not Event.objects.exists()


def test_a_takeover_waits_for_the_fenced_block_in_flight() -> None:
    """The fence holds the lease row: a claim racing a fenced block lands after its commit, so
    the old epoch's writes all come before the new epoch begins."""
    held = leases.claim(owner="a", ttl=0.5, renew_deadline=0.4)
    entered = threading.Event()
    results: dict[str, Any] = {}

    def take_over() -> None:
        entered.wait(5)
        results["b"] = leases.claim(owner="b", ttl=60)
        connection.close()

    thread = threading.Thread(target=take_over)
    thread.start()
    with leases.fenced(held):
        write_event("in flight")
        entered.set()
        # Hold the block open past the lease's expiry on the database clock.
        thread.join(1.0)
        assert thread.is_alive(), "the takeover must wait for the fenced transaction"
    thread.join(10)
    assert results["b"].is_leader and results["b"].epoch == 2
    assert Event.objects.filter(message="in flight").count() == 1


def test_a_holder_frozen_inside_a_fence_is_cut_off_after_one_ttl(settings: Any) -> None:
    """A holder stopped mid-transaction (SIGSTOP, a stalled VM) would hold the lease row lock
    for as long as it is stopped, and a standby's claim would wait behind it for ever. The
    server ends the frozen session after a TTL of idling: the standby leads and nothing the
    frozen block wrote is kept."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no server to end a session: one process holds its file lock")
    settings.LLMGW_LEASE_TTL = 1.0
    held = leases.claim(owner="a", ttl=1.0, renew_deadline=0.6)
    results: dict[str, Any] = {}

    def take_over() -> None:
        results["b"] = leases.claim(owner="b", ttl=60)
        connection.close()

    thread = threading.Thread(target=take_over)
    with pytest.raises(DatabaseError), leases.fenced(held):
        write_event("written while frozen")
        thread.start()
        # Frozen: the holder sends nothing until the standby has its answer (or the
        # generous timeout says the standby is stuck behind the lock).
        thread.join(60)
        assert not thread.is_alive(), "the standby's claim waited on the frozen holder"
        write_event("written after thawing")  # the session is gone
    connection.close()
    assert results["b"].is_leader and results["b"].epoch == 2
    assert not Event.objects.filter(message__startswith="written").exists()


@contextmanager
def sqlite_write_lock_held() -> Iterator[None]:
    """SQLite's one write lock, held by another connection for the block (at most 10 s)."""
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        outside = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
        try:
            outside.execute("BEGIN IMMEDIATE")
            locked.set()
            release.wait(10)
            outside.execute("ROLLBACK")
        finally:
            outside.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert locked.wait(10), "the outside connection took the write lock"
        yield
    finally:
        release.set()
        thread.join(30)


def busy_timeout_ms() -> int:
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout")
        return int(cursor.fetchone()[0])


def test_a_renew_that_meets_sqlites_write_lock_counts_as_store_unreachable(
    fake_clock: FakeClock,
) -> None:
    """[L14] The renew waits for SQLite's write lock no longer than its renew deadline (not
    the 20 s busy timeout): the claim is kept until its own deadline, as for a store that
    cannot be reached, and the next round renews. Other writers still wait the busy timeout."""
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one write lock; PostgreSQL locks rows")
    usual = busy_timeout_ms()
    held = leases.claim(owner="a", renew_deadline=0.3, clock=fake_clock)
    with sqlite_write_lock_held():
        kept = leases.claim(owner="a", previous=held, renew_deadline=0.3, clock=fake_clock)
        assert busy_timeout_ms() == usual
    assert kept.is_leader and kept.epoch == held.epoch
    assert "database is locked" in kept.store_error
    renewed = leases.claim(owner="a", previous=kept, clock=fake_clock)
    assert renewed.is_leader and not renewed.store_error and renewed.epoch == held.epoch


def test_a_fenced_block_waits_for_sqlites_write_lock_only_until_its_deadline(
    fake_clock: FakeClock,
) -> None:
    """[L14] A fenced block that cannot take the write lock before its holder's deadline
    fails as a store error (the tick is aborted, nothing written), not after the busy
    timeout."""
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one write lock; PostgreSQL locks rows")
    usual = busy_timeout_ms()
    held = leases.claim(owner="a", renew_deadline=0.3, clock=fake_clock)
    with sqlite_write_lock_held():
        with pytest.raises(DatabaseError, match="locked"), leases.fenced(held, clock=fake_clock):
            write_event("behind the lock")
        assert busy_timeout_ms() == usual
    assert not Event.objects.exists()
    with leases.fenced(held, clock=fake_clock):
        write_event("after the lock")
    assert Event.objects.filter(message="after the lock").count() == 1


def test_a_restarted_control_plane_takes_a_released_lease_at_once() -> None:
    """A clean stop released it: the new process (a new owner id) leads on its first claim,
    with the next epoch, without waiting out the TTL."""
    before = leases.claim(owner="host:1:old", ttl=60)
    assert leases.release(before)
    after = leases.claim(owner="host:2:new", ttl=60)
    assert after.is_leader and after.epoch == before.epoch + 1


def test_a_single_control_plane_with_default_settings_holds_the_lease() -> None:
    result = leases.claim()
    assert result.is_leader and result.may_act()
    with leases.fenced(result):
        write_event("single control plane")
    view = leases.read()
    assert view is not None and view.owner == leases.owner_id() and view.epoch == 1
    assert Event.objects.count() == 1


def test_advance_moves_a_lower_epoch_above_the_one_an_agent_saw() -> None:
    lead = leases.claim(owner="a", ttl=60)
    moved = leases.advance_epoch(lead, 12)
    assert moved.is_leader and moved.epoch == 13
    view = leases.read()
    assert view is not None and (view.owner, view.epoch) == ("a", 13)
    with leases.fenced(moved):
        write_event("at the new epoch")
    assert Event.objects.count() == 1
    # The old epoch's writes are fenced out: this process now acts as epoch 13 only.
    with pytest.raises(leases.LeadershipLost), leases.fenced(lead):
        write_event("stale")
    renewed = leases.claim(owner="a", previous=moved, ttl=60)
    assert renewed.epoch == 13


def test_advance_leaves_an_epoch_at_or_above_the_agents_alone() -> None:
    lead = leases.claim(owner="a", ttl=60)
    assert leases.advance_epoch(lead, 1) == lead
    assert leases.advance_epoch(lead, 0) == lead
    view = leases.read()
    assert view is not None and view.epoch == 1


def test_advance_by_a_deposed_owner_changes_nothing() -> None:
    old = leases.claim(owner="a", ttl=0)
    leases.claim(owner="b", ttl=60)
    result = leases.advance_epoch(old, 12)
    assert not result.is_leader
    view = leases.read()
    assert view is not None and (view.owner, view.epoch) == ("b", 2)


def test_leader_election_cannot_be_turned_off() -> None:
    env = {**os.environ, "LLMGW_LEADER_ELECTION": "false", "SECRET_KEY": "x" * 50}
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "LLMGW_LEADER_ELECTION cannot be turned off" in done.stderr


def test_owner_id_is_stable_within_a_process_and_random() -> None:
    assert leases.owner_id() == leases.owner_id()
    import socket

    assert leases.owner_id() != socket.gethostname()
