"""The dashboard and the account page in a real headless Chromium, over a real cluster.

One control plane (web process, Celery worker and beat, Redis) and two agents with simulated GPUs
run on loopback; the reconciler places a model on them, the official ``openai`` client sends
real traffic through ``/v1``, and usage rows come from that traffic. Then a browser:

- signs in as staff, sees nodes, GPUs, models (one pending, with the reason), the leader and
  the traffic charts on ``/admin/``, and watches the page update without a reload;
- creates an API key in the admin, sees it once, then only its prefix;
- signs in as a user who is not staff, is refused the admin, and sees only their own usage.

The last hour (and alice's last month) also gets usage rows written straight to the
database, so the charts have a history to draw beyond the minute the test runs in; every
assertion about what a page shows is about the real traffic or counted from the database.

Screenshots go to the test's folder, and to ``docs/`` when ``LLMGW_SAVE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from control.models import Event, ServedModel
from gateway.identity.keys import KEY_PREFIX
from gateway.models import ApiKey, UsageRecord
from tests.harness.browser import Browser
from tests.harness.cluster import Cluster, ready_replicas
from tests.harness.factories import PASSWORD, make_key, make_model, make_user
from tests.harness.procs import REPO_ROOT
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(420)]

KEY_RE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}")
ALICE_REQUESTS = 14
BOB_REQUESTS = 5


def send_traffic(base_url: str, key: str, count: int, model: str = "llama3") -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    for i in range(count):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"hello number {i}"}],
            max_tokens=4 + i % 5,
            stream=i % 2 == 0,
        )
        if not isinstance(reply, openai.types.chat.ChatCompletion):
            for _ in reply:
                pass


def write_history(api_key: ApiKey, model: str, *, minutes: int, days: int, seed: int) -> int:
    """Usage rows for the hour before this minute (a few per minute, some slow, some failed)
    and a few a day for the days before today. Returns how many."""
    rng = random.Random(seed)
    now = timezone.now()
    this_minute = now.replace(second=0, microsecond=0)
    rows = []
    for m in range(1, minutes):
        for _ in range(rng.randint(3, 9) + (m % 20 < 6) * 6):
            rows.append((this_minute - timedelta(minutes=m, seconds=rng.uniform(0, 59)), rng))
    for d in range(1, days):
        for _ in range(rng.randint(2, 12)):
            rows.append((now - timedelta(days=d, minutes=rng.uniform(0, 600)), rng))
    UsageRecord.objects.bulk_create(
        UsageRecord(
            request_id=f"history-{seed}-{i}",
            api_key=api_key,
            user_id=api_key.user_id,
            model=model,
            endpoint="chat",
            upstream="replica:history",
            status=503 if r.random() < 0.03 else 200,
            stream=r.random() < 0.5,
            prompt_tokens=r.randint(20, 400),
            completion_tokens=r.randint(10, 300),
            ttft_ms=r.lognormvariate(5.0, 0.5),
            duration_ms=r.uniform(300, 4000),
            finish_reason="stop",
            started_at=at,
        )
        for i, (at, r) in enumerate(rows)
    )
    return len(rows)


@pytest.fixture
def running_cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "cluster")
    cluster.start_redis()
    try:
        cluster.add_control_plane()
        cluster.add_agent("gpu-a", gpus="2x80GiB")
        cluster.add_agent("gpu-b", gpus="4x24GiB")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "chromium")
    try:
        yield b
    finally:
        b.close()


def save(browser: Browser, tmp_path: Path, name: str, *, full_page: bool = True) -> Path:
    shot = tmp_path / name
    browser.screenshot(shot, full_page=full_page)
    if os.environ.get("LLMGW_SAVE_SCREENSHOTS") == "1":
        shutil.copy(shot, REPO_ROOT / "docs" / name)
    return shot


def dashboard_loaded(browser: Browser) -> Callable[[], Any]:
    return lambda: browser.eval("document.getElementById('llmgw-dashboard').dataset.loaded")


def sign_in(browser: Browser, url: str, username: str) -> None:
    browser.goto(url)
    browser.type("#id_username", username)
    browser.type("#id_password", PASSWORD)
    browser.submit("[type=submit]")


def test_dashboard_and_account_pages_in_a_real_browser_over_a_real_cluster(
    running_cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    cluster = running_cluster
    base = cluster.control_planes[0].url
    make_user("root", superuser=True)
    make_user("alice")
    make_user("bob")
    make_model("llama3", min_replicas=1, max_replicas=1, memory_gib=60, startup_timeout_s=30)
    make_model("qwen2-7b", min_replicas=1, max_replicas=1, memory_gib=16, startup_timeout_s=30)
    make_model("giant", min_replicas=1, memory_gib=400, startup_timeout_s=30)

    wait_until(
        lambda: ready_replicas("llama3") == 1 and ready_replicas("qwen2-7b") == 1,
        what="llama3 and qwen2-7b to be placed and ready",
    )
    wait_until(
        lambda: ServedModel.objects.get(name="giant").placement_note,
        what="the reconciler to say why giant cannot be placed",
    )
    alice_key, alice = make_key("alice", name="alice-laptop")
    bob_key, bob = make_key("bob", name="bob-laptop")
    wait_until(lambda: _serves(base, alice_key), what="the gateway to route llama3")
    wait_until(lambda: _serves(base, bob_key, "qwen2-7b"), what="the gateway to route qwen2-7b")
    send_traffic(base, alice_key, ALICE_REQUESTS)
    send_traffic(base, bob_key, BOB_REQUESTS, model="qwen2-7b")
    # +1 each: the request that found the route.
    wait_until(
        lambda: (
            UsageRecord.objects.filter(api_key=alice).count() == ALICE_REQUESTS + 1
            and UsageRecord.objects.filter(api_key=bob).count() == BOB_REQUESTS + 1
        ),
        what="usage rows for every request",
    )
    history = write_history(alice, "llama3", minutes=60, days=30, seed=1)
    history += write_history(bob, "qwen2-7b", minutes=60, days=0, seed=2)

    # --- staff: the dashboard --------------------------------------------------------------
    sign_in(browser, f"{base}/admin/login/?next=/admin/", "root")
    assert browser.url == f"{base}/admin/"
    wait_until(dashboard_loaded(browser), what="the dashboard's first poll")
    nodes = browser.text("#lg-nodes")
    assert "gpu-a" in nodes and "gpu-b" in nodes
    assert re.search(r"llama3#\d+", nodes), nodes  # the GPU holding the replica is labelled
    assert nodes.count("free") >= 4
    models = browser.text("#lg-models")
    assert re.search(r"llama3\s+1 / 1", models) and re.search(r"qwen2-7b\s+1 / 1", models)
    assert "pending: needs" in models and "giant" in models
    lease = browser.text("#lg-lease")
    assert re.search(r"epoch \d+", lease) and "s left" in lease
    drawn = "document.querySelectorAll('#lg-chart-rps polyline, #lg-chart-rps circle').length"
    assert browser.eval(drawn) >= 2  # one line per model
    assert "llama3" in browser.text("#lg-chart-ttft") and "qwen2-7b" in browser.text(
        "#lg-chart-ttft"
    )
    assert "placed replica" in browser.text("#lg-events")
    assert "live · updated" in browser.text("#lg-live")
    save(browser, tmp_path, "dashboard.png")

    # It updates itself: a new event appears without a reload.
    marker = "browser-test marker event"
    Event.objects.create(kind=Event.Kind.OPERATOR, subject="test/browser", message=marker)
    before = browser.eval("performance.timeOrigin")
    browser.wait_text("#lg-events", marker)
    assert browser.eval("performance.timeOrigin") == before

    # On a phone: one column, nothing wider than the screen.
    browser.viewport(390, 844, mobile=True)
    browser.goto(f"{base}/admin/")
    wait_until(dashboard_loaded(browser), what="the dashboard on a phone")
    assert browser.eval("document.documentElement.scrollWidth") <= 390
    save(browser, tmp_path, "dashboard-phone.png", full_page=False)
    browser.viewport(1366, 900)

    # --- staff: a key, shown once -----------------------------------------------------------
    browser.goto(f"{base}/admin/gateway/apikey/add/")
    browser.click(".field-user .select2-selection")
    browser.page("Input.insertText", {"text": "alice"})
    wait_until(
        lambda: browser.eval(
            "(e => e && e.innerText)"
            "(document.querySelector('.select2-results__option--highlighted'))"
        ) == "alice", what="the user search to offer alice",
    )  # fmt: skip
    browser.press("Enter", 13)
    browser.type("#id_name", "made-in-the-browser")
    browser.submit("input[name=_save]")
    shown = set(KEY_RE.findall(browser.text("#llmgw-new-key")))
    assert len(shown) == 1
    new_key = shown.pop()
    row = ApiKey.objects.get(name="made-in-the-browser")
    assert row.user.username == "alice" and new_key.startswith(row.prefix)
    browser.goto(f"{base}/admin/gateway/apikey/")
    listing = browser.text("#result_list")
    assert row.prefix in listing and new_key not in browser.eval(
        "document.documentElement.outerHTML"
    )
    browser.goto(f"{base}/admin/gateway/apikey/{row.pk}/change/")
    assert new_key not in browser.eval("document.documentElement.outerHTML")
    # The new key works against /v1: it is a real key.
    wait_until(lambda: _serves(base, new_key), what="the new key to be accepted")

    # --- a user who is not staff --------------------------------------------------------------
    browser.submit("#logout-form button")
    sign_in(browser, f"{base}/account/login/", "alice")
    assert browser.url == f"{base}/account/"
    browser.goto(f"{base}/admin/")
    assert "/admin/login/" in browser.url
    assert "not authorized to access this page" in browser.text()
    assert "gpu-a" not in browser.text()
    status = browser.eval(f"fetch('{base}/admin/dashboard.json').then(r => r.status)")
    assert status == 403

    browser.goto(f"{base}/account/")
    page = browser.text()
    assert alice.prefix in page and row.prefix in page
    assert bob.prefix not in page and "bob" not in page
    assert "qwen2-7b" not in page
    # Her latest rows are the real traffic (the one request with the admin-made key last).
    assert browser.eval("document.querySelectorAll('#lg-usage tbody tr').length") == 25
    first_key_cells = browser.eval(
        "[...document.querySelectorAll('#lg-usage tbody tr td:nth-child(3)')].slice(0, 2)"
        ".map(td => td.innerText)"
    )
    assert first_key_cells[0].startswith(row.prefix) and first_key_cells[1].startswith(alice.prefix)
    assert browser.eval("document.querySelectorAll('#lg-usage-chart rect').length") == 30
    hers = UsageRecord.objects.filter(user__username="alice")
    assert hers.exclude(request_id__startswith="history-").count() == ALICE_REQUESTS + 2
    assert UsageRecord.objects.count() == ALICE_REQUESTS + 2 + BOB_REQUESTS + 1 + history
    by_model = browser.text("#lg-by-model").split()
    assert by_model[by_model.index("llama3") + 1] == str(hers.count())
    save(browser, tmp_path, "account.png")

    assert browser.console_errors == []
    assert User.objects.get(username="alice").is_staff is False


def _serves(base: str, key: str, model: str = "llama3") -> bool:
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "ping"}], max_tokens=1
        )
    except openai.APIError:
        return False
    return True
