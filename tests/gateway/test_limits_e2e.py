"""Limits shared by several web processes (one key, two web processes): atomic
reservations, on the store (the embedded default) and on Redis."""

from __future__ import annotations

import json
import threading
from email.message import Message
from functools import partial
from pathlib import Path

import pytest

from tests.harness.factories import make_key, serve_model
from tests.harness.live import http, routes, start_sim, start_web, stop_checked, wait_for_rows
from tests.harness.redis import RedisServer
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("counters", ["store", "redis"])
def test_two_web_processes_let_through_exactly_the_keys_rpm(
    tmp_path: Path, counters: str, request: pytest.FixtureRequest
) -> None:
    extra = {}
    if counters == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        extra["REDIS_URL"] = redis.url
    sim = start_sim(tmp_path, ["lim"])
    webs = [start_web(tmp_path / "var", **extra), start_web(tmp_path / "var", **extra)]
    try:
        key, api_key = make_key(rpm=10)
        serve_model("lim", [sim.port])
        for web in webs:
            wait_until(partial(routes, web, key, "lim"), what=f"{web.name} routes lim")
        body = json.dumps(
            {"model": "lim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        ).encode()
        results: list[tuple[int, Message]] = []
        lock = threading.Lock()

        def call(index: int) -> None:
            status, headers, _ = http(
                "POST", webs[index % 2].url + "/v1/chat/completions", key=key, body=body
            )
            with lock:
                results.append((status, headers))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(30)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        statuses = sorted(status for status, _ in results)
        # Unless the minute turned during the burst, exactly the limit passes.
        assert statuses.count(200) in (10, 20), statuses
        refused = [h for s, h in results if s == 429]
        assert len(refused) == 30 - statuses.count(200)
        assert all(1 <= int(h["Retry-After"]) <= 60 for h in refused)
        rows = wait_for_rows(api_key, 30)
        assert sorted(r.status for r in rows) == statuses
    finally:
        stop_checked(*webs)
        sim.stop()
