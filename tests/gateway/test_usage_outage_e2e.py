"""Usage rows and budgets while the store is away from a live web process (U3): real web
processes and ``sim`` engines, clients of the official ``openai`` package, and the store cut
through a TCP proxy between the web process and PostgreSQL (``tests/harness/proxy.py``).

The documented choice: the request path journals each row locally and the background writer
stores it once the store is back, a row replayed twice still being one row; a limit that
cannot be checked is not waived (503, ``limits_unavailable``), and a key without limits
needs nothing of the store.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models import F, Sum

from gateway.models import ApiKey, LimitCounter, UsageRecord
from tests.harness.factories import make_key, serve_model
from tests.harness.live import (
    WEB_SETTINGS,
    engine_requests,
    http,
    routes,
    sim_metrics,
    start_sim,
    stop_checked,
)
from tests.harness.procs import Proc, web_process
from tests.harness.proxy import TcpProxy
from tests.harness.store import child_env, store_behind_proxy
from tests.harness.traffic import StreamingClients, latency_report
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

OUTAGE_S = 8.0  # past the key cache's TTL, the pool's timeout and several flushes
TOKENS = 16


@dataclass
class Behind:
    """One engine serving ``u``, and web processes whose store is behind one proxy."""

    sim: Proc
    proxy: TcpProxy
    var: Path
    env: dict[str, str]
    webs: list[Proc] = field(default_factory=list)

    def start_web(self) -> Proc:
        self.webs.append(web_process("web", self.var / "logs", self.env))
        return self.webs[-1]


@pytest.fixture
def behind(tmp_path: Path) -> Iterator[Behind]:
    if connection.vendor != "postgresql":
        pytest.skip("the store is cut through a TCP proxy: PostgreSQL only")
    sim = start_sim(tmp_path, ["u"])
    var = tmp_path / "var"
    # No Redis: the limit counters are in the store too.
    # A key cache TTL longer than the cuts: keys are trusted as long as their last confirmation
    # (docs/operations.md, "When the store or Redis is away"), and the cuts are what is tested.
    settings = {**WEB_SETTINGS, "LLMGW_SHUTDOWN_GRACE": "1", "LLMGW_KEY_CACHE_TTL": "60"}
    env = child_env(LLMGW_VAR_DIR=str(var), **settings)
    proxy = store_behind_proxy(env)
    assert proxy is not None
    behind = Behind(sim, proxy, var, env)
    try:
        serve_model("u", [sim.port])
        yield behind
    finally:
        stop_checked(*behind.webs)
        proxy.close()
        sim.stop()


BODY = json.dumps(
    {"model": "u", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
).encode()
RESERVATION = len(BODY) // 4 + 4  # what gateway.identity.limits.plan reserves for BODY


def ask(web: Proc, key: str) -> tuple[int, str]:
    """(status, error code) of one completion."""
    status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=BODY)
    return status, "" if status == 200 else json.loads(raw)["error"]["code"]


def engine_idle(sim: Proc) -> bool:
    return sim_metrics(sim).get("vllm:num_requests_running", 0) == 0


def budget_used(prefix: str) -> int | None:
    return (
        LimitCounter.objects.filter(name__startswith=prefix).values_list("used", flat=True).first()
    )


def recorded_tokens(api_key: ApiKey) -> int:
    rows = UsageRecord.objects.filter(api_key=api_key, status=200)
    return int(rows.aggregate(t=Sum(F("prompt_tokens") + F("completion_tokens")))["t"] or 0)


def test_u3_the_store_away_from_a_live_web_process_under_traffic(behind: Behind) -> None:
    """[U3] The store cut for a while under four streaming clients, twice: every request that
    reached the engine has exactly one usage row once the store is back, written by the same
    process the first time, replayed from the journal of a process killed during the second
    cut by its successor; a budget is not waived while it cannot be checked, is enforced after,
    and its counter holds what the rows say was spent, counted once."""
    free, free_key = make_key("free")
    budget = 200
    budgeted, budget_key = make_key("budgeted", budget=budget)
    web = behind.start_web()
    wait_until(lambda: routes(web, free, "u"), what="the web process routes u")
    assert ask(web, budgeted) == (200, ""), "the key is known to the process before the cut"
    reached_before = engine_requests(behind.sim)

    # The first cut: the same process writes every row once the store is back.
    traffic = StreamingClients([web.url], free, "u", clients=4, tokens=TOKENS)
    with traffic.running():
        wait_until(lambda: traffic.count() >= 20, what="traffic under way")
        cut_at = time.monotonic()
        behind.proxy.cut()
        wait_until(lambda: time.monotonic() - cut_at > 4, what="the cut to be noticed")
        refused = ask(web, budgeted)
        wait_until(lambda: time.monotonic() - cut_at >= OUTAGE_S, what="the outage to end")
        restored_at = time.monotonic()
        behind.proxy.restore()
        wait_until(lambda: traffic.count(restored_at) >= 20, what="traffic after the cut")
    answers = traffic.seen()
    print()
    print(latency_report("before the first cut", traffic.seen(0, cut_at)))
    print(latency_report("during the first cut", traffic.seen(cut_at, restored_at)))
    assert [a for a in answers if not a.whole] == []
    assert traffic.seen(cut_at, restored_at), "requests were answered during the cut"
    assert refused == (503, "limits_unavailable"), "a budget that cannot be checked is kept"
    ids = {a.request_id for a in answers}
    wait_until(
        lambda: UsageRecord.objects.filter(request_id__in=ids).count() == len(ids),
        what="a row for every answer",
        logs=[web],
    )
    assert UsageRecord.objects.filter(api_key=free_key).count() == len(ids)
    assert engine_requests(behind.sim) - reached_before == len(ids)

    # The budget, with the store back: enforced, and its counter counted once.
    statuses = [ask(web, budgeted)[0] for _ in range(40)]
    assert statuses.count(200) >= 1 and statuses[-1] == 429, statuses
    asked = 2 + len(statuses)  # the one before the cut, the one during it, and these
    wait_until(
        lambda: UsageRecord.objects.filter(api_key=budget_key).count() == asked,
        what="the budgeted key's rows",
    )
    spent = recorded_tokens(budget_key)
    assert spent <= budget + RESERVATION, "at most the budget and one reservation"
    counter = "budget:key:" + budget_key.prefix
    wait_until(lambda: budget_used(counter) == spent, what=f"the counter at {spent} tokens")

    # The second cut: the process is killed during it, its successor replays its journal.
    reached_before = engine_requests(behind.sim)
    rows_before = UsageRecord.objects.filter(api_key=free_key).count()
    traffic = StreamingClients([web.url], free, "u", clients=4, tokens=TOKENS)
    with traffic.running():
        wait_until(lambda: traffic.count() >= 10, what="traffic under way")
        behind.proxy.cut()
        wait_until(lambda: traffic.count() >= 40, what="requests answered during the cut")
        web.signal(signal.SIGKILL)
        web.wait()
    killed = traffic.seen()
    assert [a for a in killed if a.whole], "some were answered before the kill"
    behind.proxy.restore()
    wait_until(lambda: engine_idle(behind.sim), what="the engine to see its clients go")
    reached = engine_requests(behind.sim) - reached_before
    successor = behind.start_web()
    wait_until(lambda: routes(successor, free, "u"), what="the successor routes u")
    # Its first request starts its usage writer, whose first sweep replays the journal.
    assert ask(successor, free) == (200, "")
    reached += 1
    wait_until(
        lambda: UsageRecord.objects.filter(api_key=free_key).count() - rows_before == reached,
        what="a row for every request that reached the engine",
        logs=[successor],
    )
    assert not list((behind.var / "usage").glob(f"*.{web.pid}-*.journal")), "replayed"
    whole = {a.request_id for a in killed if a.whole}
    assert UsageRecord.objects.filter(request_id__in=whole).count() == len(whole)
    # Replayed once: another sweep adds nothing.
    call_command("replay_usage", dir=behind.var / "usage")
    assert UsageRecord.objects.filter(api_key=free_key).count() - rows_before == reached
