"""The control plane at fleet scale, scaled down (N21, C10): ``make bench-fleet``'s run
(bench/fleet/) with 100 simulated nodes (``python -m agents.fleet``) and 50 models, against
the test database on PostgreSQL and a private Redis, two web processes and one worker. It
asserts what must hold whatever the machine's speed: no GPU or port given twice (the cluster
tests' store checker, and the fleet's own check of its live engines), every node connected and
served its desired state, before and after the leader's control plane is killed, no handshake
refused, and the store connections the web processes hold within their pools. The times are
the benchmark's business.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection

from bench.fleet.phases import run
from bench.fleet.rig import Options
from tests.harness.store import database_url_for_children

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(900)]

POOL_MAX = 4


@pytest.fixture
def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("a fleet with two web processes shares its store only on PostgreSQL")


def test_a_hundred_nodes_are_placed_without_double_allocation_and_come_back_after_a_kill(
    tmp_path: Path, postgres_only: None
) -> None:
    options = Options(
        nodes=100,
        gpus_per_node=8,
        models=50,
        wave=20,
        steady=5.0,
        duration=5.0,
        ready_delay=1.0,
        database_url=database_url_for_children(),
        create_database=False,
        work=tmp_path,
        settings={"LLMGW_DB_POOL_MAX": str(POOL_MAX)},
    )
    report = run(options, say=lambda text: None)

    invariants = report["invariants"]
    assert invariants["store_checks"] > 0
    assert invariants["store_violations"] == []
    assert invariants["fleet_gpu_conflicts"] == []
    # Every replica the catalog's minimums and the wave asked for was placed and became ready
    # (run() waits for exactly that), on a fleet where every node was served.
    assert report["placement"]["replicas"] > 0
    assert report["wave"]["models"] == 20
    assert report["storm"]["refused"] == 0
    assert report["storm"]["reconnections"] > 0
    assert report["connections"]["web_max"] <= 2 * POOL_MAX
    assert report["storm"]["web_connections_after"].get("llmgw-cp2", 0) <= POOL_MAX
