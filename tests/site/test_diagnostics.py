"""The admin's diagnostics (``llmgw_site.diagnostics``): who may see them, what they answer,
and where they are served. The views gather from real processes' channels in this test
process's var folder (``tests.harness.diagnosed``, doing known things), through Django's test
client; ``test_diagnostics_e2e`` asks llmgw's own processes over a real admin listener."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client, override_settings

from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from llmgw_site.diagnostics.process import folder, peers
from llmgw_site.listeners import Answer, decide
from tests.harness.diagnosed import Diagnosed, started
from tests.harness.factories import make_user

BASE = "/admin/diagnostics/"
DATA = ["processes", "processes.txt", "stacks", "stacks.txt", "heap", "heap.txt", "objects"]


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Diagnosed]:
    with started(folder(), tmp_path_factory.mktemp("diagnosed")) as process:
        yield process


def staff_client(name: str = "ops", *, enforce_csrf_checks: bool = False) -> Client:
    client = Client(enforce_csrf_checks=enforce_csrf_checks)
    client.force_login(make_user(name, staff=True))
    return client


def token_client(scope: str = AdminToken.Scope.READ) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {tokens.issue('diag', scope=scope).token}")


# --------------------------------------------------------------------------- where


@pytest.mark.parametrize("path", ["/admin/diagnostics/", "/admin/diagnostics/profile.svg"])
def test_the_diagnostics_are_served_by_the_admin_listener_only(path: str) -> None:
    assert decide("admin", frozenset({"admin"}), "http", path) is Answer.SITE
    for role in ("client", "metrics", "agent"):
        split = frozenset({"admin", "metrics", "agent"})
        assert decide(role, split, "http", path) is Answer.NOT_FOUND
    # Without an admin listener the one port serves the admin, and these with it.
    assert decide("client", frozenset(), "http", path) is Answer.SITE


# --------------------------------------------------------------------------- who


@pytest.mark.django_db
@pytest.mark.parametrize("path", DATA)
def test_without_a_token_or_a_staff_session_the_data_answer_401(path: str) -> None:
    response = Client().get(BASE + path)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"
    member = Client()
    member.force_login(make_user("plain"))
    assert member.get(BASE + path).status_code == 401
    wrong = Client(HTTP_AUTHORIZATION="Bearer llmgw-admin-not-a-token")
    assert wrong.get(BASE + path).status_code == 401


@pytest.mark.django_db
def test_signed_out_the_page_sends_to_the_sign_in() -> None:
    response = Client().get(BASE)
    assert response.status_code == 302
    assert response["Location"] == f"/admin/login/?next={BASE}"


@pytest.mark.django_db
def test_a_staff_member_sees_every_process_on_the_page(diagnosed: Diagnosed) -> None:
    client = staff_client()
    page = client.get(BASE)
    assert page.status_code == 200
    body = page.content.decode()
    assert f"{diagnosed.proc.pid}" in body and "test " in body  # the process table
    for link in ("stacks.txt", "profile.svg", "profile.folded", "heap.txt", "objects.txt"):
        assert f'"{BASE}{link}"' in body
    # The dashboard links the page.
    assert f'href="{BASE}"' in client.get("/admin/").content.decode()


@pytest.mark.django_db
def test_a_read_only_token_reads_every_diagnostic(diagnosed: Diagnosed) -> None:
    client = token_client()
    pid = diagnosed.proc.pid
    stacks = client.get(BASE + "stacks", {"pid": pid})
    assert stacks.status_code == 200
    assert stacks["Cache-Control"] == "no-store"
    (answer,) = stacks.json()["processes"]
    assert answer["pid"] == pid and answer["role"] == "test"
    assert {"MainThread", "busy"} <= {t["name"] for t in answer["answer"]["threads"]}
    text = client.get(BASE + "stacks.txt", {"pid": pid})
    assert text["Content-Type"] == "text/plain; charset=utf-8"
    assert "spin_in_a_known_function" in text.content.decode()
    objects = client.get(BASE + "objects.txt", {"pid": pid, "top": 200}).content.decode()
    assert "__main__.Leaked" in objects and "generation 0:" in objects
    processes = client.get(BASE + "processes", {"pid": pid}).json()["processes"]
    assert processes[0]["answer"]["memory"]["rss_bytes"] > 0


@pytest.mark.django_db
def test_the_profile_comes_as_a_flame_graph_folded_stacks_and_text(
    diagnosed: Diagnosed,
) -> None:
    client = token_client()
    query: dict[str, int | str] = {"pid": diagnosed.proc.pid, "seconds": 1}
    svg = client.get(BASE + "profile.svg", query)
    assert svg.status_code == 200
    assert svg["Content-Type"] == "image/svg+xml"
    assert svg["Content-Disposition"].startswith('inline; filename="llmgw-profile-')
    assert svg["Content-Security-Policy"].startswith("default-src 'none'")
    assert "spin_in_a_known_function" in svg.content.decode()
    saved = client.get(BASE + "profile.svg", {**query, "download": 1})
    assert saved["Content-Disposition"].startswith("attachment;")
    folded = client.get(BASE + "profile.folded", {**query, "mode": "wall"}).content.decode()
    lines = folded.splitlines()
    assert lines and all(line.rsplit(" ", 1)[1].isdigit() for line in lines)
    assert all(line.startswith(f"test {diagnosed.proc.pid};") for line in lines)
    text = client.get(BASE + "profile.txt", query).content.decode()
    assert "self ms" in text and "spin_in_a_known_function" in text


@pytest.mark.django_db
def test_bad_parameters_are_refused_by_name(diagnosed: Diagnosed) -> None:
    client = token_client()
    for query, named in (
        ({"seconds": "soon"}, "seconds='soon' is not a number"),
        ({"seconds": 9999}, "seconds must be between"),
        ({"mode": "gpu"}, "mode must be one of cpu, wall"),
        ({"pid": "me"}, "pid must be a process id"),
    ):
        response = client.get(BASE + "profile.svg", query)
        assert response.status_code == 400
        assert named in response.json()["error"]["message"]
    assert client.post(BASE + "stacks").status_code == 405


@pytest.mark.django_db
def test_heap_tracing_switches_from_a_token_or_a_session_with_its_csrf_token(
    diagnosed: Diagnosed,
) -> None:
    pid = diagnosed.proc.pid
    # A read-only token may switch it: it changes what is measured, not what llmgw does.
    started_by_token = token_client().post(f"{BASE}heap?pid={pid}", {"action": "start"})
    assert started_by_token.status_code == 200
    assert started_by_token.json()["processes"][0]["answer"]["tracing"] is True
    session = staff_client(enforce_csrf_checks=True)
    refused = session.post(f"{BASE}heap?pid={pid}", {"action": "stop"})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_failed"
    report = json.loads(session.get(BASE + "heap", {"pid": pid}).content)
    assert report["processes"][0]["answer"]["tracing"] is True
    # From the page: its form carries the token, and the answer leads back to the page.
    session.get(BASE)
    csrf = session.cookies["csrftoken"].value
    stopped = session.post(
        f"{BASE}heap?pid={pid}",
        {"action": "stop", "next": "page", "csrfmiddlewaretoken": csrf},
    )
    assert stopped.status_code == 303 and stopped["Location"] == BASE
    after = session.get(BASE + "heap.txt", {"pid": pid}).content.decode()
    assert "tracemalloc is off" in after
    assert session.post(BASE + "heap", {"action": "explode"}, HTTP_X_CSRFTOKEN=csrf).json()[
        "error"
    ]["message"] == ("action must be one of start, stop, rebase")


@pytest.mark.django_db
@override_settings(LLMGW_DIAGNOSTICS=False)
def test_with_diagnostics_off_nothing_is_gathered() -> None:
    assert token_client().get(BASE + "stacks").status_code == 404
    assert "Diagnostics are off" in staff_client().get(BASE).content.decode()


def test_the_store_and_redis_are_counted_where_the_settings_say() -> None:
    postgres = {"ENGINE": "django.db.backends.postgresql", "HOST": "db.internal", "PORT": ""}
    store, redis = peers(postgres, "redis://cache.internal:6380/0")
    assert (store.name, store.host, store.port) == ("store", "db.internal", 5432)
    assert (redis.name, redis.host, redis.port) == ("redis", "cache.internal", 6380)
    # Unix sockets: whose connection is whose cannot be told from /proc.
    local = {"ENGINE": "django.db.backends.postgresql", "HOST": "/run/postgresql"}
    assert [p.where() for p in peers(local, "unix:///run/redis.sock")] == ["unknown", "unknown"]
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/llmgw/llmgw.sqlite3"}
    assert [p.where() for p in peers(sqlite, "")] == ["/srv/llmgw/llmgw.sqlite3"]


def test_the_channels_live_in_the_var_folder(settings: Any) -> None:
    settings.VAR_DIR = Path("/srv/llmgw/var")
    assert folder() == Path("/srv/llmgw/var/diagnostics")
