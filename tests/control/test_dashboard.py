"""The /admin/ dashboard: the data it shows, what it costs, and who may see it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from control import dashboard, leases
from control.models import Event, Node, Replica
from gateway.ledger import traffic as gateway_traffic
from gateway.ledger.traffic import TTFT_BOUNDS_MS, quantile
from llmgw_site.views import dashboard_snapshot
from tests.harness.factories import (
    make_key,
    make_model,
    make_node,
    make_replica,
    make_usage,
    make_user,
)


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    """The dashboard caches minutes that are over; each test starts without them."""
    cache.clear()


# --------------------------------------------------------------------------- pure


def test_quantile_interpolates_inside_the_bucket_the_rank_falls_in() -> None:
    bounds = (100.0, 200.0, 400.0)
    # 10 under 100 ms, 10 more under 200 ms, none slower.
    assert quantile(0.5, bounds, [10, 20, 20], 20) == pytest.approx(100.0)
    assert quantile(0.25, bounds, [10, 20, 20], 20) == pytest.approx(50.0)
    assert quantile(0.75, bounds, [10, 20, 20], 20) == pytest.approx(150.0)


def test_quantile_beyond_the_last_bound_answers_the_last_bound() -> None:
    assert quantile(0.95, (100.0, 200.0), [0, 1], 10) == 200.0


def test_quantile_of_nothing_is_none() -> None:
    assert quantile(0.5, (100.0,), [0], 0) is None


def test_quantile_with_every_sample_in_one_bucket_stays_inside_it() -> None:
    bounds = TTFT_BOUNDS_MS
    cumulative = [0 if b < 300 else 50 for b in bounds]  # all 50 between 200 and 300 ms
    p50 = quantile(0.5, bounds, cumulative, 50)
    p95 = quantile(0.95, bounds, cumulative, 50)
    assert p50 is not None and p95 is not None
    assert 200 <= p50 <= p95 <= 300


# --------------------------------------------------------------------------- the snapshot


@pytest.fixture
def cluster(db: Any) -> dict[str, Any]:
    """Two nodes, one model ready on GPU 0 of the first, one that cannot be placed."""
    gpu1 = make_node("gpu-1", gpus=[(81920, 40960), (81920, 512)])
    gpu2 = make_node("gpu-2", gpus=[(24576, 0)], schedule=Node.Schedule.CORDONED)
    llama = make_model("llama3", min_replicas=1)
    big = make_model("deepseek", min_replicas=1)
    big.placement_note = "needs 8×80 GiB on one node; largest free is 1×80 GiB on gpu-1"
    big.save()
    replica = make_replica(llama, [(gpu1, [0])])
    Event.objects.create(kind=Event.Kind.PLACEMENT, subject="model/llama3", message="placed #1")
    return {"gpu1": gpu1, "gpu2": gpu2, "replica": replica}


def test_snapshot_shows_nodes_with_gpus_allocated_and_free(cluster: dict[str, Any]) -> None:
    data = dashboard.snapshot()
    nodes = {n["name"]: n for n in data["nodes"]}
    assert nodes["gpu-1"]["state"] == "ready"
    assert nodes["gpu-2"]["state"] == "cordoned"
    assert nodes["gpu-1"]["url"] == f"/admin/control/node/{cluster['gpu1'].pk}/change/"
    gpus = nodes["gpu-1"]["gpus"]
    assert gpus[0]["allocated_to"] == f"llama3#{cluster['replica'].pk}"
    assert gpus[0]["memory_used_mib"] == 40960 and gpus[0]["memory_total_mib"] == 81920
    assert gpus[1]["allocated_to"] is None
    assert data["summary"] == {
        "nodes": 2,
        "nodes_ready": 1,
        "gpus": 3,
        "gpus_allocated": 1,
        "replicas_ready": 1,
        "replicas_desired": 1,
    }


def test_a_stopped_replica_whose_shard_has_stopped_frees_its_gpus(
    cluster: dict[str, Any],
) -> None:
    replica = cluster["replica"]
    Replica.objects.filter(pk=replica.pk).update(desired=Replica.Desired.STOPPED)
    # Still running: the GPU is still held.
    assert dashboard.allocated_gpu_keys() == {(cluster["gpu1"].pk, 0): f"llama3#{replica.pk}"}
    replica.shards.update(observed=Replica.Observed.STOPPED)
    assert dashboard.allocated_gpu_keys() == {}


def test_snapshot_says_why_a_model_is_pending(cluster: dict[str, Any]) -> None:
    models = {m["name"]: m for m in dashboard.snapshot()["models"]}
    assert models["llama3"]["ready"] == 1 and models["llama3"]["desired"] == 1
    assert models["deepseek"]["ready"] == 0
    assert models["deepseek"]["placement_note"].startswith("needs 8×80 GiB")


def test_snapshot_shows_the_latest_events_first(cluster: dict[str, Any]) -> None:
    Event.objects.create(kind=Event.Kind.NODE, subject="node/gpu-2", message="later")
    events = dashboard.snapshot()["events"]
    assert [e["message"] for e in events[:2]] == ["later", "placed #1"]


@pytest.mark.django_db(transaction=True)
def test_lease_shows_holder_epoch_and_time_left(election_on: Any) -> None:
    assert dashboard.snapshot()["lease"]["held"] is False
    leases.claim(owner="cp-a:1:abc", ttl=30)
    lease = dashboard.snapshot()["lease"]
    assert lease["holder"] == "cp-a:1:abc" and lease["epoch"] == 1 and lease["held"] is True
    assert 25 < lease["expires_in"] <= 30


@pytest.mark.django_db
def test_traffic_per_minute_has_rates_errors_and_ttft_percentiles() -> None:
    make_user("alice")
    _, key = make_key("alice")
    now = timezone.now().replace(second=30, microsecond=0)
    minute_ago = now - timedelta(minutes=1)
    for ttft in (100, 100, 100, 100, 100, 100, 100, 100, 100, 1900):
        make_usage(model="llama3", api_key=key, started_at=minute_ago, ttft_ms=ttft,
                   prompt_tokens=50, completion_tokens=10)  # fmt: skip
    make_usage(model="llama3", api_key=key, started_at=minute_ago, status=503, ttft_ms=None)
    make_usage(model="qwen", api_key=key, started_at=now - timedelta(minutes=90))  # too old

    traffic = gateway_traffic.traffic(now)
    assert list(traffic["models"]) == ["llama3"]
    series = traffic["models"]["llama3"]
    i = len(traffic["minutes"]) - 2  # the minute before the current one
    assert series["requests_per_s"][i] == pytest.approx(11 / 60, abs=1e-3)
    assert series["tokens_per_s"][i] == pytest.approx((10 * 60 + 30) / 60, abs=0.1)
    assert series["errors"][i] == 1
    assert 75 <= series["ttft_p50_ms"][i] <= 100
    assert 1500 <= series["ttft_p95_ms"][i] <= 2000
    assert series["requests_per_s"][i - 1] == 0 and series["ttft_p50_ms"][i - 1] is None


@pytest.mark.django_db
def test_traffic_shows_the_share_of_prompt_tokens_the_engines_had_cached() -> None:
    make_user("alice")
    _, key = make_key("alice")
    now = timezone.now().replace(second=30, microsecond=0)
    for minutes_ago, cached in ((1, 900), (1, 300), (2, 0)):
        make_usage(model="llama3", api_key=key, started_at=now - timedelta(minutes=minutes_ago),
                   prompt_tokens=1000, cached_tokens=cached)  # fmt: skip
    make_usage(model="qwen", api_key=key, started_at=now - timedelta(minutes=1), prompt_tokens=0)

    traffic = gateway_traffic.traffic(now)
    llama3 = traffic["models"]["llama3"]
    i = len(traffic["minutes"]) - 2
    assert llama3["prefix_hit_ratio_per_minute"][i] == 0.6
    assert llama3["prefix_hit_ratio_per_minute"][i - 1] == 0.0
    assert llama3["prefix_hit_ratio_per_minute"][i - 2] is None
    assert llama3["prefix_hit_ratio"] == 0.4  # 1,200 of 3,000 prompt tokens over the hour
    assert traffic["models"]["qwen"]["prefix_hit_ratio"] is None  # no prompt tokens at all


@pytest.mark.django_db
def test_snapshot_costs_a_fixed_number_of_queries(django_assert_max_num_queries: Any) -> None:
    make_user("alice")
    _, key = make_key("alice")
    for n in range(6):
        node = make_node(f"gpu-{n}", gpus=[(81920, 0)] * 4)
        model = make_model(f"model-{n}")
        make_replica(model, [(node, [0, 1])])
        for _ in range(5):
            make_usage(model=model.name, api_key=key)
    # The first poll of a minute; later ones 7. One of them reads the lease (always competed for).
    with django_assert_max_num_queries(8):
        data = dashboard_snapshot()
    assert len(data["nodes"]) == 6 and len(data["traffic"]["models"]) == 6


# --------------------------------------------------------------------------- the page


@pytest.mark.django_db
def test_the_admin_index_is_the_dashboard_for_staff(cluster: dict[str, Any]) -> None:
    client = Client()
    client.force_login(make_user("root", superuser=True))
    page = client.get("/admin/")
    text = page.content.decode()
    assert page.status_code == 200
    assert 'id="llmgw-dashboard" data-url="/admin/dashboard.json"' in text
    assert "llmgw/dashboard.js" in text and "llmgw/charts.js" in text
    assert "/admin/control/node/" in text  # the admin's model list is still there
    data = client.get("/admin/dashboard.json")
    assert data.status_code == 200
    assert data["Cache-Control"] == "no-store"
    assert [n["name"] for n in data.json()["nodes"]] == ["gpu-1", "gpu-2"]


@pytest.mark.django_db
def test_dashboard_json_for_staff_without_model_permissions_still_needs_staff(
    cluster: dict[str, Any],
) -> None:
    client = Client()
    client.force_login(make_user("clerk", staff=True))
    assert client.get("/admin/dashboard.json").status_code == 200
    inactive = make_user("gone", staff=True)
    inactive.is_active = False
    inactive.save()
    client.force_login(inactive)
    assert client.get("/admin/dashboard.json").status_code in (401, 403)


@pytest.mark.django_db
def test_minutes_that_are_over_are_aggregated_once_and_the_current_one_each_poll(
    django_assert_num_queries: Any,
) -> None:
    make_user("alice")
    _, key = make_key("alice")
    now = timezone.now().replace(second=40, microsecond=0)
    make_usage(model="llama3", api_key=key, started_at=now - timedelta(minutes=5))
    with django_assert_num_queries(2):
        first = gateway_traffic.traffic(now)
    make_usage(model="llama3", api_key=key, started_at=now - timedelta(seconds=5))
    with django_assert_num_queries(1):
        second = gateway_traffic.traffic(now + timedelta(seconds=5))
    assert sum(first["models"]["llama3"]["requests_per_s"]) == pytest.approx(1 / 60, abs=1e-3)
    assert second["models"]["llama3"]["requests_per_s"][-1] > 0  # the new row, at once
    assert (
        second["models"]["llama3"]["requests_per_s"][-6]
        == first["models"]["llama3"]["requests_per_s"][-6]
    )
    # The window moves on: only the minute that ended is aggregated (its one row), not the
    # hour again; a row written late into a minute already aggregated shows once the
    # dashboard is told to forget (a journal replayed), not before.
    later = now + timedelta(minutes=1)
    make_usage(model="llama3", api_key=key, started_at=now - timedelta(minutes=5))
    with CaptureQueriesContext(connection) as queries:
        third = gateway_traffic.traffic(later)
    assert len(queries) == 2
    assert third["models"]["llama3"]["requests_per_s"][-7] == pytest.approx(1 / 60, abs=1e-3)
    gateway_traffic.forget_settled()
    fourth = gateway_traffic.traffic(later)
    assert fourth["models"]["llama3"]["requests_per_s"][-7] == pytest.approx(2 / 60, abs=1e-3)
