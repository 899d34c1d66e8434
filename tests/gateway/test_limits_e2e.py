"""Limits shared by several web processes (one key, two daphne processes): atomic
reservations, on the store (the embedded default) and on Redis."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from tests.harness.live import http, make_key, serve_model, start_sim, start_web, wait_for_rows
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("counters", ["store", "redis"])
def test_two_web_processes_let_through_exactly_the_keys_rpm(tmp_path: Path, counters: str) -> None:
    if counters == "redis" and not redis_reachable():
        if os.environ.get("CI"):
            pytest.fail("Redis must be reachable on CI")
        pytest.skip("no Redis on 127.0.0.1:6379")
    extra = {"REDIS_URL": REDIS_URL} if counters == "redis" else {}
    sim = start_sim(tmp_path, ["lim"])
    webs = [start_web(tmp_path, **extra), start_web(tmp_path, **extra)]
    try:
        key, api_key = make_key(rpm=10)
        serve_model("lim", [sim.port])
        for web in webs:
            models_url = web.url + "/v1/models"

            def listed(url: str = models_url) -> bool:
                return b'"lim"' in http("GET", url, key=key)[2]

            wait_until(listed)
        body = json.dumps(
            {"model": "lim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        ).encode()
        results: list[tuple[int, dict[str, str]]] = []
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
            thread.join(30)
        statuses = sorted(status for status, _ in results)
        # Unless the minute turned during the burst, exactly the limit passes.
        assert statuses.count(200) in (10, 20), statuses
        refused = [h for s, h in results if s == 429]
        assert len(refused) == 30 - statuses.count(200)
        assert all(1 <= int(h["Retry-After"]) <= 60 for h in refused)
        rows = wait_for_rows(api_key, 30)
        assert sorted(r.status for r in rows) == statuses
    finally:
        for proc in (*webs, sim):
            proc.stop()
