"""Prometheus metrics: guarded by a bearer token, summed over web processes, fleet from the
store, and accepted by ``promtool check metrics`` on a scrape taken while traffic flows."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from control import leases
from control.models import Node
from llmgw_site import views
from telemetry import metrics
from tests.harness.factories import make_key, make_model, make_node, make_replica, serve_model
from tests.harness.live import http, start_sim, start_web, stop_checked
from tests.harness.procs import REPO_ROOT, Proc
from tests.harness.store import process_env
from tests.harness.waits import wait_until

TOKEN = "metrics-test-token-0123456789"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def promtool(text: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool is not installed (apt-get install prometheus; see the Makefile)"
    return subprocess.run(
        [tool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def token(settings: Any) -> str:
    settings.LLMGW_METRICS_TOKEN = TOKEN
    return TOKEN


def scrape_via_client() -> str:
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    return response.content.decode()


# --------------------------------------------------------------------------- exposure


@pytest.mark.django_db
def test_metrics_are_off_unless_a_token_is_configured(settings: Any) -> None:
    settings.LLMGW_METRICS_TOKEN = ""
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer anything")
    assert response.status_code == 404
    assert "LLMGW_METRICS_TOKEN" in response.json()["error"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "header", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer"]
)
def test_metrics_without_the_right_bearer_token_are_401(token: str, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    response = Client().get("/metrics", headers=headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"llmgw_" not in response.content


@pytest.mark.django_db
def test_metrics_with_the_token_are_the_prometheus_text_format(token: str) -> None:
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"# TYPE llmgw_nodes gauge" in response.content
    openmetrics = Client().get(
        "/metrics",
        HTTP_AUTHORIZATION=f"Bearer {TOKEN}",
        HTTP_ACCEPT="application/openmetrics-text; version=1.0.0",
    )
    assert openmetrics["Content-Type"].startswith("application/openmetrics-text")
    assert openmetrics.content.rstrip().endswith(b"# EOF")


# --------------------------------------------------------------------------- our metrics


@pytest.mark.django_db
def test_observed_requests_show_as_counters_and_histograms_per_model_and_status(
    token: str,
) -> None:
    model = f"m-{uuid.uuid4().hex[:8]}"  # the multiprocess files outlive a test run
    metrics.observe_request(
        model, 200, prompt_tokens=12, completion_tokens=30, ttft_s=0.08, duration_s=0.9
    )
    metrics.observe_request(
        model, 200, prompt_tokens=8, completion_tokens=10, ttft_s=3.0, duration_s=4.0
    )
    metrics.observe_request(
        model, 503, prompt_tokens=0, completion_tokens=0, ttft_s=None, duration_s=0.01
    )
    metrics.observe_upstream_error(model, "connect")
    metrics.observe_retry(model, "connect")
    metrics.observe_activation_wait(model, 42.0, "ready")
    metrics.observe_cold_start(model, 75.0)
    text = scrape_via_client()

    assert value(text, "llmgw_requests_total", model=model, status="200") == 2
    assert value(text, "llmgw_requests_total", model=model, status="503") == 1
    assert value(text, "llmgw_tokens_total", model=model, kind="prompt") == 20
    assert value(text, "llmgw_tokens_total", model=model, kind="completion") == 40
    ttft = {"model": model, "status": "200"}
    assert value(text, "llmgw_time_to_first_token_seconds_count", **ttft) == 2
    assert value(text, "llmgw_time_to_first_token_seconds_bucket", le="0.1", **ttft) == 1
    assert value(text, "llmgw_time_to_first_token_seconds_bucket", le="5.0", **ttft) == 2
    # No first byte, no TTFT sample; the duration is still observed.
    assert value(text, "llmgw_time_to_first_token_seconds_count", model=model, status="503") is None
    assert value(text, "llmgw_request_duration_seconds_count", model=model, status="503") == 1
    assert value(text, "llmgw_request_duration_seconds_sum", **ttft) == pytest.approx(4.9)
    assert value(text, "llmgw_upstream_errors_total", model=model, reason="connect") == 1
    assert value(text, "llmgw_upstream_retries_total", model=model, reason="connect") == 1
    assert value(text, "llmgw_activation_wait_seconds_count", model=model, outcome="ready") == 1
    assert value(text, "llmgw_replica_cold_start_seconds_sum", model=model) == 75.0


def our_samples() -> str:
    """This process's own values of the request path's metrics, as written so far (read from
    the process, not the shared folder, which other tests' processes may reset)."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


async def test_requests_on_an_event_loop_are_tallied_then_written_as_observe_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics, "FLUSH_EVERY_S", 3600.0)  # written below, by hand
    model = f"m-{uuid.uuid4().hex[:8]}"
    # On a bound, just past one, zero, and past the last bound (+Inf).
    seconds = [0.0, 0.025, 0.0251, 0.1, 7.5, 120.0, 120.5, 900.0]
    for s in seconds:
        metrics.observe_request(
            model, 200, prompt_tokens=2, completion_tokens=3, ttft_s=s, duration_s=s
        )
    labels = {"model": model, "status": "200"}
    assert value(our_samples(), "llmgw_requests_total", **labels) is None  # only tallied

    metrics.write_tallies()
    text = our_samples()
    assert value(text, "llmgw_requests_total", **labels) == len(seconds)
    assert value(text, "llmgw_tokens_total", model=model, kind="prompt") == 2 * len(seconds)
    assert value(text, "llmgw_tokens_total", model=model, kind="completion") == 3 * len(seconds)
    for name, bounds in (
        ("llmgw_time_to_first_token_seconds", metrics.TTFT_BUCKETS),
        ("llmgw_request_duration_seconds", metrics.DURATION_BUCKETS),
    ):
        for bound in bounds:
            expected = sum(1 for s in seconds if s <= bound)
            assert value(text, f"{name}_bucket", le=str(bound), **labels) == expected, bound
        assert value(text, f"{name}_bucket", le="+Inf", **labels) == len(seconds)
        assert value(text, f"{name}_sum", **labels) == pytest.approx(sum(seconds))


def test_a_loop_gone_before_its_write_does_not_stop_the_next_loops_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = f"m-{uuid.uuid4().hex[:8]}"

    async def observe() -> None:
        metrics.observe_request(
            model, 200, prompt_tokens=1, completion_tokens=1, ttft_s=0.1, duration_s=0.1
        )

    monkeypatch.setattr(metrics, "FLUSH_EVERY_S", 3600.0)
    asyncio.run(observe())  # tallied; its loop is gone before the write comes due

    async def observe_and_wait_for_the_write() -> None:
        await observe()
        async with asyncio.timeout(30):
            while metrics._writer_loop is not None:
                await asyncio.sleep(0)

    monkeypatch.setattr(metrics, "FLUSH_EVERY_S", 0.0)
    asyncio.run(observe_and_wait_for_the_write())
    assert value(our_samples(), "llmgw_requests_total", model=model, status="200") == 2


@pytest.mark.django_db
def test_requests_waiting_for_activation_are_a_live_gauge(token: str) -> None:
    model = f"m-{uuid.uuid4().hex[:8]}"
    with metrics.waiting_for_activation(model), metrics.waiting_for_activation(model):
        assert value(scrape_via_client(), "llmgw_activation_waiting", model=model) == 2
    assert value(scrape_via_client(), "llmgw_activation_waiting", model=model) == 0


@pytest.mark.django_db
def test_an_empty_model_label_becomes_unknown_not_a_new_series(token: str) -> None:
    before = value(scrape_via_client(), "llmgw_requests_total", model="(unknown)", status="404")
    metrics.observe_request(
        "", 404, prompt_tokens=0, completion_tokens=0, ttft_s=None, duration_s=0
    )
    after = value(scrape_via_client(), "llmgw_requests_total", model="(unknown)", status="404")
    assert after == (before or 0) + 1


# --------------------------------------------------------------------------- the fleet


@pytest.mark.django_db
def test_fleet_gauges_are_read_from_the_store_at_scrape_time(token: str) -> None:
    gpu1 = make_node("gpu-1", gpus=[(81920, 1024), (81920, 0)])
    make_node("gpu-2", gpus=[(24576, 0)], schedule=Node.Schedule.DRAINING)
    make_node("gpu-3", gpus=[], health=Node.Health.LOST)
    llama = make_model("llama3")
    make_replica(llama, [(gpu1, [0])], ready_after_s=42)
    make_replica(llama, [(gpu1, [1])], observed="starting", ready_after_s=None)
    text = scrape_via_client()

    assert value(text, "llmgw_store_up") == 1
    assert value(text, "llmgw_nodes", state="ready") == 1
    assert value(text, "llmgw_nodes", state="draining") == 1
    assert value(text, "llmgw_nodes", state="lost") == 1
    assert value(text, "llmgw_nodes", state="unreachable") == 0
    assert value(text, "llmgw_gpus") == 3
    assert value(text, "llmgw_gpus_allocated") == 2
    assert value(text, "llmgw_gpu_memory_total_bytes") == (81920 * 2 + 24576) * 1024 * 1024
    assert value(text, "llmgw_gpu_memory_used_bytes") == 1024 * 1024 * 1024
    assert value(text, "llmgw_replicas", model="llama3", state="ready") == 1
    assert value(text, "llmgw_replicas", model="llama3", state="starting") == 1
    assert value(text, "llmgw_replica_last_cold_start_seconds", model="llama3") == pytest.approx(
        42, abs=1
    )


@pytest.mark.django_db(transaction=True)
def test_leader_and_epoch_are_in_the_fleet_gauges(token: str, election_on: Any) -> None:
    leases.claim(owner="cp-a:1:abc", ttl=30)
    text = scrape_via_client()
    assert value(text, "llmgw_lease_held") == 1
    assert value(text, "llmgw_leader_epoch") == 1
    assert value(text, "llmgw_leader_info", owner="cp-a:1:abc") == 1
    remaining = value(text, "llmgw_lease_expires_in_seconds")
    assert remaining is not None and 25 < remaining <= 30


@pytest.mark.django_db
def test_a_scrape_with_the_store_down_still_answers_and_says_so(
    token: str, store_unreachable: None
) -> None:
    text = views.scrape()[0].decode()
    assert value(text, "llmgw_store_up") == 0
    assert "llmgw_nodes" not in text


# --------------------------------------------------------------------------- processes


def test_a_dead_processes_live_gauges_are_dropped_and_its_counters_kept(tmp_path: Path) -> None:
    """A web process killed while requests waited must not leave them counted as waiting."""
    code = (
        "import django, os\n"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'llmgw_site.settings'\n"
        "django.setup()\n"
        "from telemetry import metrics\n"
        "metrics.WAITING.labels('m').inc(3)\n"
        "metrics.observe_request('m', 200, prompt_tokens=1, completion_tokens=2,"
        " ttft_s=0.1, duration_s=0.2)\n"
        "os._exit(0)\n"  # like kill -9: no clean-up at exit
    )
    env = process_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True, timeout=60)

    def collected() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        return samples(generate_latest(registry).decode())

    assert collected()[("llmgw_activation_waiting", (("model", "m"),))] == 3
    dead = metrics.forget_dead_processes(tmp_path)
    assert len(dead) == 1
    after = collected()
    assert ("llmgw_activation_waiting", (("model", "m"),)) not in after
    assert after[("llmgw_requests_total", (("model", "m"), ("status", "200")))] == 1


def test_reset_empties_the_folder(tmp_path: Path) -> None:
    (tmp_path / "counter_123.db").write_bytes(b"x")
    (tmp_path / "gauge_livesum_123.db").write_bytes(b"x")
    metrics.reset_multiprocess_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.django_db
def test_promtool_accepts_a_scrape_with_every_family_populated(token: str) -> None:
    node = make_node("gpu-1", gpus=[(81920, 0)])
    make_replica(make_model("llama3"), [(node, [0])])
    metrics.observe_request(
        "llama3", 200, prompt_tokens=1, completion_tokens=1, ttft_s=0.1, duration_s=0.2
    )
    metrics.observe_upstream_error("llama3", "status_5xx")
    metrics.observe_retry("llama3", "status_5xx")
    metrics.observe_activation_wait("llama3", 1.0, "timeout")
    metrics.observe_cold_start("llama3", 10.0)
    result = promtool(scrape_via_client())
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- two web processes


@pytest.fixture(scope="module")
def two_web_processes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Proc, Proc, Proc]]:
    """One engine and two web processes sharing their metrics, for the module: each test
    sends its traffic for a model of its own, so its counts are its own."""
    tmp = tmp_path_factory.mktemp("metrics")
    shared = tmp / "prometheus"
    shared.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(shared), "LLMGW_METRICS_TOKEN": TOKEN}
    started: list[Proc] = []
    try:
        started.append(start_sim(tmp, ["metrics-chat", "metrics-count"]))
        for i in range(2):
            started.append(start_web(tmp / f"w{i}", **env))
        yield started[0], started[1], started[2]
    finally:
        stop_checked(*started[1:])
        started[0].stop()


def listed(client: openai.OpenAI, model: str = "metrics-chat") -> bool:
    return model in [m.id for m in client.models.list().data]


def scrape(web: Proc) -> str:
    status, _, body = http(
        "GET", web.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 200, body
    return body.decode()


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_promtool_passes_on_a_scrape_taken_while_traffic_flows_through_two_web_processes(
    two_web_processes: tuple[Proc, Proc, Proc],
) -> None:
    sim, web_a, web_b = two_web_processes
    served = serve_model("metrics-chat", [sim.port])
    key, _ = make_key("metrics-user")
    clients = [
        openai.OpenAI(base_url=w.url + "/v1", api_key=key, max_retries=0, timeout=60)
        for w in (web_a, web_b)
    ]
    for c in clients:
        wait_until(partial(listed, c))

    sent = {web_a.port: 0, web_b.port: 0}
    for i in range(12):
        web, c = (web_a, clients[0]) if i % 3 == 0 else (web_b, clients[1])
        c.chat.completions.create(
            model="metrics-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        # A page Django serves (/healthz is answered without it), counted by django-prometheus.
        assert http("GET", web.url + "/admin/login/")[0] == 200
        sent[web.port] += 1

        if i == 6:  # mid-traffic: the scrape promtool checks is taken while requests flow
            during = scrape(web_a)
            checked = promtool(during)
            assert checked.returncode == 0, checked.stdout + checked.stderr

    # Each process saw only its share, yet a scrape of either one counts both.
    for web in (web_a, web_b):
        text = scrape(web)
        pages = value(
            text,
            "django_http_responses_total_by_status_view_method_total",
            status="200",
            view="admin:login",
            method="GET",
        )
        assert pages == sent[web_a.port] + sent[web_b.port] == 12
        assert value(text, "llmgw_replicas", model="metrics-chat", state="ready") == 1
    assert sent[web_a.port] == 4 and sent[web_b.port] == 8

    final = promtool(scrape(web_b))
    assert final.returncode == 0, final.stdout + final.stderr
    assert served.model.name == "metrics-chat"


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_v1_requests_through_two_web_processes_are_counted_once_each(
    two_web_processes: tuple[Proc, Proc, Proc],
) -> None:
    sim, web_a, web_b = two_web_processes
    serve_model("metrics-count", [sim.port])
    key, _ = make_key("metrics-user")
    for web in (web_a, web_a, web_b):
        c = openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=60)
        wait_until(partial(listed, c, "metrics-count"))
        c.chat.completions.create(
            model="metrics-count", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )

    def counted(text: str) -> tuple[float | None, ...]:
        return (
            value(text, "llmgw_requests_total", model="metrics-count", status="200"),
            value(text, "llmgw_tokens_total", model="metrics-count", kind="completion"),
            value(
                text, "llmgw_time_to_first_token_seconds_count", model="metrics-count", status="200"
            ),
        )

    # Each process writes its metrics to the shared files within a second of a request, one
    # metric after another: a scrape meanwhile may see one counted and the next not yet.
    text = wait_until(
        lambda: (t := scrape(web_b)) and counted(t) == (3, 9, 3) and t,
        what="the three requests counted, with their tokens and times to first token",
    )
    assert json.dumps(text)  # the whole exposition is text
