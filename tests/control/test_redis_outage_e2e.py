"""End to end, with real processes: Redis (channel layer, broker, shared counters) cut off
from a running control plane through a TCP proxy, then restarted without its data, while
clients of the official ``openai`` package stream through the gateway. Scenario codes are
those of docs/scenarios.md.

What is documented, and asserted here: a limit that cannot be checked is not waived (503
``limits_unavailable`` at once) and a key without limits needs nothing of Redis; a cold model's
queue of waiters cannot be counted, so its requests are refused at once (503
``queue_unavailable``) rather than let past ``max_waiting``; agent streams stay up and what
the channel layer's nudges would have said is delivered by their resyncs; a budget counter
Redis lost is lifted back to what the records show was spent, and nothing is counted twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import redis
from django.db.models import F, Sum

from control.models import ServedModel
from gateway.identity import limits
from gateway.models import ApiKey, UsageRecord
from tests.harness.cluster import Cluster, node_health, ready_replicas, running_cluster
from tests.harness.factories import make_key, make_model
from tests.harness.live import http, routes
from tests.harness.traffic import Answer, StreamingClients, latency_report
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(600)]

OUTAGE_S = 6.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(tmp_path, redis_via_proxy=True) as cluster:
        yield cluster


def timed_post(url: str, key: str, model: str) -> tuple[int, str, str, float]:
    """(status, error code, Retry-After, seconds) of one completion."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    ).encode()
    began = time.monotonic()
    status, headers, raw = http("POST", url + "/v1/chat/completions", key=key, body=body)
    code = "" if status == 200 else json.loads(raw)["error"]["code"]
    return status, code, str(headers.get("Retry-After", "")), time.monotonic() - began


def budget_counter(client: redis.Redis[bytes], api_key: ApiKey) -> int:
    name = limits.budget_counter(f"key:{api_key.prefix}", 0, "month", 0, time.time()).name
    return int(client.get(f"llmgw:{name}") or 0)


def spent(api_key: ApiKey) -> int:
    rows = UsageRecord.objects.filter(api_key=api_key, status=200)
    return int(rows.aggregate(t=Sum(F("prompt_tokens") + F("completion_tokens")))["t"] or 0)


def whole_since(clients: StreamingClients, moment: float) -> bool:
    """A request sent a second after ``moment`` was answered whole."""
    return any(a.whole for a in clients.seen(moment + 1))


def counted_once(client: redis.Redis[bytes], api_key: ApiKey, answers: list[Answer]) -> None:
    """Once every answer has its row, the key's budget counter holds what the rows say was
    spent: a counter that lost spend is lifted to it by the leader; one above it would stay."""
    wait_until(
        lambda: UsageRecord.objects.filter(api_key=api_key).count() >= len(answers),
        what="the limited key's rows",
    )
    wait_until(
        lambda: budget_counter(client, api_key) == spent(api_key),
        what=f"the budget counter at the {spent(api_key)} tokens recorded",
    )


def refused_for_limits(answer: Answer) -> bool:
    return answer.status == 503 and "limits" in answer.error.lower()


def test_g21_redis_cut_then_restarted_under_traffic(cluster: Cluster) -> None:
    """[G21] Redis unreachable for a while, then restarted without its data, under streaming
    traffic of a key without limits and of a limited one: the first is answered throughout;
    the second is refused at once (503) while its limits cannot be checked, served before and
    after; a cold model's request is refused at once while its waiters cannot be counted; the
    agent's stream stays up and a change made after is delivered; the budget counter is
    lifted back to the spend the records show after the restart, and holds exactly that when
    the traffic stops: nothing counted twice; no process exits."""
    plane = cluster.add_control_plane(LLMGW_BUDGET_REFRESH_INTERVAL="1")
    cluster.add_agent("a", gpus="2x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    make_model("hot", min_replicas=1, max_replicas=2, idle_timeout_s=3600, startup_timeout_s=30)
    make_model("cold", min_replicas=0, max_replicas=1, max_waiting=4, startup_timeout_s=30)
    free, free_key = make_key("free")
    limited, limited_key = make_key("limited", rpm=1_000_000, budget=10**9)
    wait_until(lambda: ready_replicas("hot") == 1, what="one ready hot", logs=cluster.processes())
    assert plane.web is not None and cluster.redis is not None
    wait_until(partial(routes, plane.web, free, "hot"), what="the web process routes hot")
    direct = redis.Redis(port=cluster.redis.port)  # the test's own view of Redis, unproxied
    engines = cluster.agents["a"].engines()
    unlimited = StreamingClients([plane.url], free, "hot", clients=4)
    during_cut = StreamingClients([plane.url], limited, "hot", clients=2)
    during_restart = StreamingClients([plane.url], limited, "hot", clients=2)
    proxy = cluster.redis_proxy
    assert proxy is not None
    with unlimited.running():
        with during_cut.running():
            wait_until(lambda: during_cut.count() >= 10, what="traffic under way")
            # Unreachable: connections cut, new ones refused.
            cut_at = time.monotonic()
            proxy.cut()
            wait_until(lambda: time.monotonic() - cut_at > 2, what="the cut to be noticed")
            cold = timed_post(plane.url, free, "cold")
            wait_until(lambda: time.monotonic() - cut_at >= OUTAGE_S, what="the outage to end")
            restored_at = time.monotonic()
            proxy.restore()
            wait_until(lambda: whole_since(during_cut, restored_at), what="limits checked again")
        # Nothing counted twice across the cut: the counter holds what the records say.
        counted_once(direct, limited_key, during_cut.seen())

        with during_restart.running():
            wait_until(lambda: during_restart.count() >= 10, what="traffic under way")
            # Restarted without its data.
            restart_at = time.monotonic()
            cluster.redis.stop()
            wait_until(lambda: time.monotonic() - restart_at > 2, what="Redis down a while")
            cluster.redis.start()
            back_at = time.monotonic()
            wait_until(lambda: whole_since(during_restart, back_at), what="limits checked again")
        wait_until(lambda: unlimited.count(back_at) >= 20, what="traffic after the restart")
    print()
    print(latency_report("no limits, during the cut", unlimited.seen(cut_at, restored_at)))
    print(latency_report("limited, during the cut", during_cut.seen(cut_at, restored_at)))
    print(latency_report("limited, Redis restarting", during_restart.seen(restart_at, back_at)))
    print(f"cold model during the cut: {cold[0]} {cold[1]} in {cold[3] * 1000:.0f} ms")

    # A key without limits needs nothing of Redis; a limited one is refused only while its
    # limits cannot be checked, with a 503, and served on either side.
    assert [a for a in unlimited.seen() if not a.whole] == []
    for clients, (start, end) in (
        (during_cut, (cut_at, restored_at)),
        (during_restart, (restart_at, back_at)),
    ):
        refused = [a for a in clients.seen() if not a.whole]
        assert all(refused_for_limits(a) for a in refused), refused[:3]
        # Refused only in the outage: sent at most 1 s before it began or answered after it
        # began, and sent within 2 s of its end or before the key was next served
        # whole after it, whichever is later: a loaded machine takes its time to bring Redis
        # back.
        served_again = min(a.began for a in clients.seen() if a.whole and a.began >= end)
        over = max(end + 2, served_again)
        early = [a for a in refused if a.began < start - 1 and a.began + a.seconds < start]
        assert early == [], (start, early[:3])
        late = [a for a in refused if a.began > over]
        assert late == [], (end, served_again, late[:3])
        assert any(refused_for_limits(a) for a in clients.seen(start, end))
    assert cold[:3] == (503, "queue_unavailable", "5")

    # Counted once: a row for every answer of the unlimited key; the budget counter Redis lost
    # lifted back to what the records show was spent, and no further.
    ids = {a.request_id for a in unlimited.seen()}
    wait_until(
        lambda: UsageRecord.objects.filter(request_id__in=ids).count() == len(ids),
        what="a row for every answer",
    )
    assert UsageRecord.objects.filter(api_key=free_key).count() == len(ids) + 1  # and cold's
    counted_once(direct, limited_key, during_cut.seen() + during_restart.seen())

    # The agent's stream stayed up: a change made now reaches it, and nothing was stopped.
    assert node_health("a") == "ready"
    ServedModel.objects.filter(name="hot").update(min_replicas=2)
    wait_until(lambda: ready_replicas("hot") == 2, what="two ready hot", logs=cluster.processes())
    assert all(pids in cluster.agents["a"].engines().values() for pids in engines.values())
    assert [p.name for p in cluster.processes() if not p.running()] == []
    direct.close()
