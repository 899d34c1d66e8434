"""``max_waiting`` bounds the requests waiting for a cold model across every web process, not
per process: two real web processes on one store (and on Redis), the official ``openai``
client, a model that stays cold (no agent runs here)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from control import gateway_counts
from tests.harness.factories import make_key, make_model
from tests.harness.live import start_web, stop_checked
from tests.harness.redis import RedisServer
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


@pytest.mark.parametrize("counters", ["store", "redis"])
def test_max_waiting_is_shared_by_two_web_processes(
    tmp_path: Path, counters: str, request: pytest.FixtureRequest, settings: object
) -> None:
    extra = {}
    if counters == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        extra["REDIS_URL"] = redis.url
        settings.REDIS_URL = redis.url  # type: ignore[attr-defined]
        gateway_counts._redis = None
        gateway_counts._client().flushall()
    model = make_model("cold", max_waiting=2, activation_timeout_s=120)
    key, _ = make_key("client")
    webs = [start_web(tmp_path / "var", **extra), start_web(tmp_path / "var", **extra)]
    clients = [
        openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=60)
        for web in webs
    ]
    streams = []
    try:
        # Two streams wait on the first process (their headers are out; they hold their slots).
        for _ in range(2):
            streams.append(
                clients[0].chat.completions.create(
                    model="cold", messages=[{"role": "user", "content": "hi"}], stream=True
                )
            )
        wait_until(lambda: gateway_counts.waiting_for(model.pk) == 2, what="two waiting")
        # The second process counts them: a third waiter anywhere is refused.
        with pytest.raises(openai.RateLimitError) as refused:
            clients[1].chat.completions.create(
                model="cold", messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.code == "model_activation_queue_full"
        # One leaves: its slot is free again for either process.
        streams.pop().close()
        wait_until(lambda: gateway_counts.waiting_for(model.pk) == 1, what="one slot given back")
    finally:
        for stream in streams:
            stream.close()
        gateway_counts._redis = None
        stop_checked(*webs)
