"""[L1], [L8] and [L12] with real processes on the backend under test."""

from __future__ import annotations

import multiprocessing
from collections import defaultdict
from typing import Any

import pytest

from control import leases
from control.models import Event
from tests.control import lease_racers
from tests.harness.store import database_url_for_children

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = 30


def collect(queue: Any, count: int) -> list[Any]:
    return [queue.get(timeout=60) for _ in range(count)]


def run_all(processes: list[Any]) -> None:
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0, f"racer exited with {process.exitcode}"


@pytest.mark.parametrize("racers", [2, 8])
def test_l1_racers_on_an_empty_lease_have_exactly_one_winner_per_round(racers: int) -> None:
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(racers)
    results = spawn.Queue()
    url = database_url_for_children()
    processes = [
        spawn.Process(target=lease_racers.race_rounds, args=(i, url, ROUNDS, barrier, results))
        for i in range(racers)
    ]
    run_all(processes)
    outcomes = collect(results, racers * ROUNDS)

    winners: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for round_number, owner, is_leader, epoch in outcomes:
        if is_leader:
            winners[round_number].append((owner, epoch))
    assert sorted(winners) == list(range(ROUNDS)), "every round has a winner"
    previous_owner, previous_epoch = "", 0
    for round_number in range(ROUNDS):
        assert len(winners[round_number]) == 1, f"round {round_number}: {winners[round_number]}"
        owner, epoch = winners[round_number][0]
        expected = previous_epoch if owner == previous_owner else previous_epoch + 1
        assert epoch == expected, f"round {round_number}: epoch {epoch}, expected {expected}"
        previous_owner, previous_epoch = owner, epoch
    assert len({outcome[1] for outcome in outcomes}) == racers, "owner ids differ per process"


def test_l8_a_racer_with_skewed_clocks_never_makes_two_leaders_of_one_epoch(settings: Any) -> None:
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(4)
    results = spawn.Queue()
    url = database_url_for_children()
    skews = [0.0, 0.0, 0.6, -3600.0]  # 2×TTL ahead, and an hour behind
    processes = [
        spawn.Process(target=lease_racers.contend, args=(i, url, 3.0, skew, start, results))
        for i, skew in enumerate(skews)
    ]
    run_all(processes)
    claims = dict(collect(results, len(skews)))
    assert all(count >= 3 for count in claims.values()), claims  # every racer took part

    writes = list(
        Event.objects.filter(subject="race").order_by("id").values_list("epoch", "message")
    )
    assert writes, "somebody led and wrote"
    owners_by_epoch: dict[int, set[str]] = defaultdict(set)
    for epoch, owner in writes:
        owners_by_epoch[epoch].add(owner)
    assert all(len(owners) == 1 for owners in owners_by_epoch.values()), owners_by_epoch
    epochs_in_commit_order = [epoch for epoch, _ in writes]
    assert epochs_in_commit_order == sorted(epochs_in_commit_order), (
        "no write of an old epoch lands after the next epoch's first write"
    )
    assert len(owners_by_epoch) > 1, "leadership changed hands at least once"


def test_l12_forked_processes_have_different_owner_ids() -> None:
    fork = multiprocessing.get_context("fork")
    results = fork.Queue()
    parent_id = leases.owner_id()

    def child() -> None:
        results.put(leases.owner_id())

    processes = [fork.Process(target=child) for _ in range(4)]
    run_all(processes)
    child_ids = collect(results, 4)
    assert len(set(child_ids)) == 4
    assert parent_id not in child_ids
    assert {f":{p.pid}:" for p in processes} == {f":{i.split(':')[1]}:" for i in child_ids}
    assert leases.owner_id() == parent_id, "the parent keeps its id"
