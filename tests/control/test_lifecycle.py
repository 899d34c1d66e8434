"""The reconciler's pure decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from control.lifecycle import (
    ModelDemand,
    ReplicaUse,
    backoff_seconds,
    eviction_candidates,
    surplus_to_stop,
    wanted_replicas,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def demand(**overrides: object) -> ModelDemand:
    values: dict[str, object] = {
        "enabled": True,
        "min_replicas": 0,
        "max_replicas": 3,
        "idle_timeout": timedelta(minutes=15),
        "activation_timeout": timedelta(minutes=10),
        "last_request_at": None,
        "demand_at": None,
    }
    values.update(overrides)
    return ModelDemand(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failures", "expected"),
    [(0, 0.0), (1, 2.0), (2, 4.0), (3, 8.0), (8, 256.0), (9, 300.0), (500, 300.0)],
)
def test_backoff_doubles_from_the_base_up_to_the_cap(failures: int, expected: float) -> None:
    assert backoff_seconds(failures, base=2.0, cap=300.0) == expected


def test_an_idle_model_with_no_minimum_wants_nothing() -> None:
    assert wanted_replicas(demand(), active=0, now=NOW) == 0


def test_minimum_replicas_are_always_wanted() -> None:
    assert wanted_replicas(demand(min_replicas=2), active=0, now=NOW) == 2


def test_waiting_demand_activates_a_cold_model() -> None:
    model = demand(demand_at=NOW - timedelta(seconds=3))
    assert wanted_replicas(model, active=0, now=NOW) == 1


def test_demand_older_than_the_activation_timeout_is_forgotten() -> None:
    model = demand(demand_at=NOW - timedelta(minutes=11))
    assert wanted_replicas(model, active=0, now=NOW) == 0


def test_a_busy_model_keeps_its_replicas_and_an_idle_one_scales_to_its_minimum() -> None:
    busy = demand(min_replicas=1, last_request_at=NOW - timedelta(minutes=1))
    assert wanted_replicas(busy, active=3, now=NOW) == 3
    idle = demand(min_replicas=1, last_request_at=NOW - timedelta(minutes=16))
    assert wanted_replicas(idle, active=3, now=NOW) == 1


def test_traffic_alone_does_not_bring_back_an_evicted_model() -> None:
    evicted = demand(last_request_at=NOW - timedelta(minutes=1))
    assert wanted_replicas(evicted, active=0, now=NOW) == 0


def test_never_more_than_the_maximum_and_nothing_when_disabled() -> None:
    assert wanted_replicas(demand(min_replicas=2, max_replicas=2, last_request_at=NOW), 5, NOW) == 2
    assert wanted_replicas(demand(min_replicas=2, enabled=False), 2, NOW) == 0


def use(replica_id: int, **overrides: object) -> ReplicaUse:
    values: dict[str, object] = {
        "replica_id": replica_id,
        "model": "m",
        "ready": True,
        "pinned": False,
        "in_flight": 0,
        "last_request_at": None,
    }
    values.update(overrides)
    return ReplicaUse(**values)  # type: ignore[arg-type]


def test_scale_down_stops_unready_first_then_least_recently_used() -> None:
    replicas = [
        use(1, last_request_at=NOW - timedelta(minutes=1)),
        use(2, last_request_at=NOW - timedelta(minutes=30)),
        use(3, ready=False),
    ]
    assert [r.replica_id for r in surplus_to_stop(replicas, wanted=1)] == [3, 2]
    assert surplus_to_stop(replicas, wanted=3) == []


def test_eviction_skips_pinned_serving_and_own_replicas_and_orders_by_last_use() -> None:
    replicas = [
        use(1, model="a", last_request_at=NOW - timedelta(minutes=5)),
        use(2, model="b", pinned=True),
        use(3, model="c", in_flight=2),
        use(4, model="target"),
        use(5, model="d", last_request_at=NOW - timedelta(hours=2)),
        use(6, model="e"),
    ]
    assert [r.replica_id for r in eviction_candidates(replicas, "target")] == [6, 5, 1]


def test_a_request_in_flight_keeps_a_model_busy_past_its_idle_timeout() -> None:
    """Idle counts from the end of the last request: a generation longer than the idle
    timeout keeps its replicas."""
    long_ago = NOW - timedelta(minutes=16)
    streaming = demand(last_request_at=long_ago, requests_in_flight=1)
    assert wanted_replicas(streaming, active=2, now=NOW) == 2
    assert wanted_replicas(demand(last_request_at=long_ago), active=2, now=NOW) == 0


def test_scale_down_never_picks_a_replica_with_a_request_in_flight() -> None:
    replicas = [
        use(1, last_request_at=NOW - timedelta(hours=1), in_flight=1),
        use(2, last_request_at=NOW - timedelta(minutes=1)),
        use(3, ready=False, in_flight=2),
    ]
    assert [r.replica_id for r in surplus_to_stop(replicas, wanted=1)] == [2]
    assert [r.replica_id for r in surplus_to_stop(replicas, wanted=0)] == [2]
