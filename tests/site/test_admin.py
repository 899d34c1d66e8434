"""The admin as the operations console: A1, A2, A5, A6, G5 at save time, and the actions."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
from django.contrib.sessions.models import Session
from django.core.cache import cache
from django.db import connection
from django.test import Client
from django.urls import reverse

from control.models import Event, Node, Profile, Replica, ServedModel
from gateway.identity.keys import KEY_PREFIX, hash_key
from gateway.models import ApiKey, Endpoint
from tests.harness.factories import (
    PASSWORD,
    make_key,
    make_model,
    make_node,
    make_profile,
    make_replica,
    make_usage,
    make_user,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    """The dashboard caches minutes that are over; each test starts without them."""
    cache.clear()


KEY_RE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}")


def staff_client(username: str = "root", **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(make_user(username, superuser=True))
    return client


def streamed(response):
    return b"".join(response.streaming_content).decode()


# --------------------------------------------------------------------------- A1


@pytest.mark.parametrize(
    "path",
    [
        "/admin/",
        "/admin/control/node/",
        "/admin/gateway/apikey/",
        "/admin/gateway/usagerecord/",
        "/admin/gateway/usagerecord/export.csv",
    ],
)
def test_admin_pages_without_a_session_redirect_to_the_login(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_dashboard_json_without_a_session_is_401_and_carries_no_data() -> None:
    make_node("gpu-1")
    response = Client().get("/admin/dashboard.json")
    assert response.status_code == 401
    assert response.json() == {"error": "not signed in"}


def test_dashboard_json_for_a_signed_in_non_staff_user_is_403() -> None:
    user = make_user("alice")
    client = Client()
    client.force_login(user)
    response = client.get("/admin/dashboard.json")
    assert response.status_code == 403
    assert "nodes" not in response.json()


def test_non_staff_user_is_refused_the_admin_index() -> None:
    client = Client()
    client.force_login(make_user("alice"))
    response = client.get("/admin/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


# --------------------------------------------------------------------------- A2


def test_state_changing_admin_posts_without_csrf_token_are_403() -> None:
    make_user("bob")
    node = make_node("gpu-1")
    client = staff_client(enforce_csrf_checks=True)
    add = client.post(
        "/admin/gateway/apikey/add/", {"user": "1", "name": "x", "budget_period": "month"}
    )
    action = client.post(
        "/admin/control/node/", {"action": "drain", "_selected_action": [str(node.pk)]}
    )
    assert add.status_code == 403
    assert action.status_code == 403
    assert not ApiKey.objects.exists()
    assert Node.objects.get(pk=node.pk).schedule == Node.Schedule.ACTIVE


def test_the_same_post_with_a_csrf_token_goes_through() -> None:
    node = make_node("gpu-1")
    client = staff_client(enforce_csrf_checks=True)
    page = client.get("/admin/control/node/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token is not None
    response = client.post(
        "/admin/control/node/",
        {
            "action": "drain",
            "_selected_action": [str(node.pk)],
            "csrfmiddlewaretoken": token.group(1),
        },
    )
    assert response.status_code == 302
    assert Node.objects.get(pk=node.pk).schedule == Node.Schedule.DRAINING


def test_login_post_without_csrf_token_is_403() -> None:
    make_user("root", superuser=True)
    response = Client(enforce_csrf_checks=True).post(
        "/admin/login/", {"username": "root", "password": PASSWORD}
    )
    assert response.status_code == 403


# --------------------------------------------------------------------------- A5


def test_staff_without_permissions_cannot_add_or_change_keys_or_models() -> None:
    owner = make_user("owner")
    _, api_key = make_key("owner")
    model = make_model("llama3")
    client = Client()
    client.force_login(make_user("clerk", staff=True))

    assert client.get("/admin/gateway/apikey/add/").status_code == 403
    assert (
        client.post(
            "/admin/gateway/apikey/add/",
            {"user": str(owner.pk), "name": "mine", "budget_period": "month"},
        ).status_code
        == 403
    )
    assert client.get(f"/admin/gateway/apikey/{api_key.pk}/change/").status_code == 403
    assert (
        client.post(
            "/admin/gateway/apikey/", {"action": "revoke", "_selected_action": [api_key.pk]}
        ).status_code
        == 403
    )
    assert (
        client.post(f"/admin/control/servedmodel/{model.pk}/change/", {"name": "x"}).status_code
        == 403
    )
    assert ApiKey.objects.count() == 1
    assert ApiKey.objects.get().revoked_at is None
    assert ServedModel.objects.get().name == "llama3"


def test_staff_with_view_permission_only_cannot_change_a_model_or_revoke_a_key() -> None:
    make_user("owner")
    _, api_key = make_key("owner")
    model = make_model("llama3", max_replicas=2)
    client = Client()
    client.force_login(
        make_user("viewer", staff=True, perms=["control.view_servedmodel", "gateway.view_apikey"])
    )
    assert client.get(f"/admin/control/servedmodel/{model.pk}/change/").status_code == 200
    posted = client.post(
        f"/admin/control/servedmodel/{model.pk}/change/",
        {"name": "llama3", "source": "x", "default_profile": model.default_profile_id,
         "min_replicas": 0, "max_replicas": 9},
    )  # fmt: skip
    assert posted.status_code == 403
    assert ServedModel.objects.get().max_replicas == 2
    # Without the change permission the revoke action is not offered, so nothing happens.
    client.post("/admin/gateway/apikey/", {"action": "revoke", "_selected_action": [api_key.pk]})
    assert ApiKey.objects.get().revoked_at is None


# --------------------------------------------------------------------------- A6


def test_a_key_made_in_the_admin_is_shown_once_then_only_its_prefix() -> None:
    alice = make_user("alice")
    client = staff_client()
    response = client.post(
        "/admin/gateway/apikey/add/",
        {"user": str(alice.pk), "name": "ci", "budget_period": "month", "allowed_models": "[]"},
    )
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    shown = KEY_RE.findall(response.content.decode())
    assert len(set(shown)) == 1
    key = shown[0]

    row = ApiKey.objects.get()
    assert row.user_id == alice.pk and row.name == "ci"
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest() == hash_key(key)
    assert row.prefix == key[: len(row.prefix)] and len(row.prefix) < len(key)

    # Never again: not on the change page, the list, or in any session or message.
    for page in ("/admin/gateway/apikey/", f"/admin/gateway/apikey/{row.pk}/change/", "/admin/"):
        text = client.get(page).content.decode()
        assert key not in text
    assert row.prefix in client.get("/admin/gateway/apikey/").content.decode()
    for session in Session.objects.all():
        assert key not in str(session.get_decoded())
    assert key not in str(client.cookies)


def test_only_the_hash_of_a_key_is_in_the_database() -> None:
    make_user("alice")
    key, _ = make_key("alice")
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM gateway_apikey")
        rows = cursor.fetchall()
    assert rows
    assert not any(key in str(value) for row in rows for value in row)
    assert any(hash_key(key) == value for row in rows for value in row)


def test_revoke_action_revokes_the_selected_key_only() -> None:
    make_user("alice")
    _, first = make_key("alice")
    _, second = make_key("alice")
    client = staff_client()
    client.post("/admin/gateway/apikey/", {"action": "revoke", "_selected_action": [first.pk]})
    assert ApiKey.objects.get(pk=first.pk).revoked_at is not None
    assert ApiKey.objects.get(pk=second.pk).revoked_at is None


# --------------------------------------------------------------------------- G5 at save time


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[fe80::1]:8000", "link-local"),
        ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
        ("http://[fd00:ec2::254]/", "metadata"),
        ("file:///etc/passwd", "valid URL"),
    ],
)
def test_endpoint_urls_pointing_at_metadata_or_link_local_are_refused(
    url: str, complaint: str
) -> None:
    client = staff_client()
    response = client.post(
        "/admin/gateway/endpoint/add/",
        {"slug": "bad", "url": url, "model_names": '["m"]', "weight": 1, "enabled": "on"},
    )
    assert response.status_code == 200  # the form again, with the error
    assert complaint in response.content.decode()
    assert not Endpoint.objects.exists()


def test_an_operator_may_allow_a_link_local_endpoint_on_purpose() -> None:
    client = staff_client()
    response = client.post(
        "/admin/gateway/endpoint/add/",
        {
            "slug": "lab",
            "url": "http://169.254.10.20:8000",
            "model_names": '["m"]',
            "weight": 1,
            "enabled": "on",
            "allow_private_address": "on",
        },
    )
    assert response.status_code == 302
    assert Endpoint.objects.get().url == "http://169.254.10.20:8000"


def test_a_private_address_endpoint_is_accepted_without_the_flag() -> None:
    client = staff_client()
    response = client.post(
        "/admin/gateway/endpoint/add/",
        {"slug": "vllm", "url": "http://10.0.0.5:8000", "model_names": '["m"]', "weight": 1},
    )
    assert response.status_code == 302
    assert Endpoint.objects.filter(slug="vllm").exists()


# --------------------------------------------------------------------------- node and replica


def test_node_actions_change_the_schedule_and_record_who_did_it() -> None:
    node = make_node("gpu-1")
    client = staff_client()
    for action, schedule in (
        ("cordon", Node.Schedule.CORDONED),
        ("drain", Node.Schedule.DRAINING),
        ("undrain", Node.Schedule.ACTIVE),
    ):
        client.post("/admin/control/node/", {"action": action, "_selected_action": [node.pk]})
        assert Node.objects.get(pk=node.pk).schedule == schedule
    messages = list(
        Event.objects.filter(kind=Event.Kind.OPERATOR, subject="node/gpu-1")
        .order_by("id")
        .values_list("message", flat=True)
    )
    assert [m.split(" ")[0] for m in messages] == ["cordoned", "draining", "active"]
    assert all("by admin:root" in m for m in messages)


def test_node_schedule_and_observed_fields_are_not_editable_in_the_form() -> None:
    node = make_node("gpu-1")
    client = staff_client()
    response = client.post(
        f"/admin/control/node/{node.pk}/change/",
        {
            "name": "gpu-1",
            "addresses": '["10.0.0.1"]',
            "labels": '{"gpu": "h100"}',
            "remove_weights": "[]",
            "schedule": "draining",
            "health": "lost",
            "gpus-TOTAL_FORMS": "1",
            "gpus-INITIAL_FORMS": "1",
            "gpus-MIN_NUM_FORMS": "0",
            "gpus-MAX_NUM_FORMS": "1000",
            "gpus-0-id": str(node.gpus.get().pk),
            "gpus-0-node": str(node.pk),
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    node.refresh_from_db()
    assert node.labels == {"gpu": "h100"}
    assert node.schedule == Node.Schedule.ACTIVE
    assert node.health == Node.Health.READY


def test_remove_weights_outside_the_weights_directory_are_refused() -> None:
    node = make_node("gpu-1")
    client = staff_client()
    response = client.post(
        f"/admin/control/node/{node.pk}/change/",
        {
            "name": "gpu-1",
            "addresses": "[]",
            "labels": "{}",
            "remove_weights": '["../etc"]',
            "gpus-TOTAL_FORMS": "0",
            "gpus-INITIAL_FORMS": "0",
        },
    )
    assert response.status_code == 200
    assert "Not a relative path inside the weights directory" in response.content.decode()
    assert Node.objects.get(pk=node.pk).remove_weights == []


def test_issue_token_action_shows_the_token_once_and_stores_its_hash() -> None:
    node = make_node("gpu-1")
    client = staff_client()
    response = client.post(
        "/admin/control/node/", {"action": "issue_token", "_selected_action": [node.pk]}
    )
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    match = re.search(r'id="llmgw-node-token" class="lg-key">([^<]+)<', response.content.decode())
    assert match is not None
    token = match.group(1).strip()
    node.refresh_from_db()
    assert node.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token not in client.get(f"/admin/control/node/{node.pk}/change/").content.decode()

    client.post("/admin/control/node/", {"action": "revoke_token", "_selected_action": [node.pk]})
    node.refresh_from_db()
    assert node.token_hash == ""


def test_restart_action_starts_a_new_generation_and_nudges_the_nodes() -> None:
    node = make_node("gpu-1", gpus=[(81920, 0), (81920, 0)])
    replica = make_replica(make_model("llama3"), [(node, [0])])
    before = node.desired_revision
    client = staff_client()
    response = client.post(
        "/admin/control/replica/", {"action": "restart", "_selected_action": [replica.pk]}
    )
    assert response.status_code == 302
    replica.refresh_from_db()
    assert replica.generation == 2
    assert replica.observed == Replica.Observed.PENDING
    assert Node.objects.get(pk=node.pk).desired_revision == before + 1
    assert Event.objects.filter(message__contains=f"replica #{replica.pk} restarted").exists()


def test_replicas_cannot_be_added_or_edited_in_the_admin() -> None:
    node = make_node("gpu-1")
    replica = make_replica(make_model("llama3"), [(node, [0])])
    client = staff_client()
    assert client.get("/admin/control/replica/add/").status_code == 403
    page = client.get(f"/admin/control/replica/{replica.pk}/change/").content.decode()
    assert 'name="observed"' not in page and 'name="desired"' not in page
    assert 'name="_save"' not in page
    assert replica.engine_key and replica.engine_key not in page  # the gateway's secret


def test_profile_with_an_env_name_the_agent_would_refuse_is_not_saved() -> None:
    client = staff_client()
    response = client.post(
        "/admin/control/profile/add/",
        {
            "name": "bad-env",
            "engine": "sim",
            "args": "[]",
            "env": '{"BAD NAME": "x"}',
            "gpus_per_shard": 1,
            "shards_per_replica": 1,
            "gpu_memory_mib": 0,
            "gpu_selector": "{}",
            "placement_strategy": "binpack",
            "health_path": "/health",
            "startup_timeout_s": 60,
        },
    )
    assert response.status_code == 200
    assert "invalid variable name" in response.content.decode()
    assert not Profile.objects.filter(name="bad-env").exists()


def test_model_with_min_above_max_is_refused_by_the_form_not_a_database_error() -> None:
    profile = make_profile()
    client = staff_client()
    response = client.post(
        "/admin/control/servedmodel/add/",
        {
            "name": "m",
            "aliases": "[]",
            "source": "s",
            "enabled": "on",
            "default_profile": profile.pk,
            "profiles": [profile.pk],
            "min_replicas": 3,
            "max_replicas": 1,
            "idle_timeout_s": 60,
            "activation_timeout_s": 60,
            "max_waiting": 10,
        },
    )
    assert response.status_code == 200
    assert "model_min_replicas_within_max" in response.content.decode()
    assert not ServedModel.objects.exists()


def test_a_models_context_length_is_set_in_the_admin_and_zero_is_refused() -> None:
    profile = make_profile()
    client = staff_client()
    form = {
        "name": "m",
        "aliases": "[]",
        "source": "s",
        "enabled": "on",
        "default_profile": profile.pk,
        "profiles": [profile.pk],
        "min_replicas": 0,
        "max_replicas": 1,
        "idle_timeout_s": 60,
        "activation_timeout_s": 60,
        "max_waiting": 10,
        "scales-TOTAL_FORMS": "0",
        "scales-INITIAL_FORMS": "0",
    }
    refused = client.post("/admin/control/servedmodel/add/", {**form, "context_length": 0})
    assert refused.status_code == 200 and not ServedModel.objects.exists()
    assert refused.context_data is not None
    assert "context_length" in refused.context_data["adminform"].form.errors
    saved = client.post("/admin/control/servedmodel/add/", {**form, "context_length": 8192})
    assert saved.status_code == 302
    assert ServedModel.objects.get().context_length == 8192


# --------------------------------------------------------------------------- usage


def test_usage_csv_export_follows_the_changelist_filters() -> None:
    make_user("alice")
    make_user("bob")
    _, alice_key = make_key("alice")
    _, bob_key = make_key("bob")
    make_usage(model="llama3", api_key=alice_key, prompt_tokens=7)
    make_usage(model="qwen", api_key=alice_key)
    make_usage(model="llama3", api_key=bob_key, prompt_tokens=9)
    client = staff_client()

    listing = client.get("/admin/gateway/usagerecord/?model=llama3").content.decode()
    assert reverse("admin:gateway_usagerecord_export") + "?model=llama3" in listing

    response = client.get(
        f"/admin/gateway/usagerecord/export.csv?model=llama3&user__id__exact={alice_key.user_id}"
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv"
    lines = streamed(response).splitlines()
    assert lines[0].startswith("request_id,started_at,user,api_key,model")
    assert len(lines) == 2
    assert ",alice," in lines[1] and ",llama3," in lines[1] and ",7," in lines[1]


def test_usage_rows_are_read_only_in_the_admin() -> None:
    make_user("alice")
    _, api_key = make_key("alice")
    row = make_usage(model="llama3", api_key=api_key)
    client = staff_client()
    assert client.get(f"/admin/gateway/usagerecord/{row.pk}/change/").status_code == 200
    response = client.post(f"/admin/gateway/usagerecord/{row.pk}/change/", {"status": 500})
    assert response.status_code == 403
    assert client.get(f"/admin/gateway/usagerecord/{row.pk}/delete/").status_code == 403


def test_usage_filters_by_day_status_and_key_without_scanning_for_choices() -> None:
    from datetime import timedelta

    from django.utils import timezone

    make_user("alice")
    _, first = make_key("alice")
    _, second = make_key("alice")
    now = timezone.now()
    make_usage(model="m", api_key=first, status=200, started_at=now)
    make_usage(model="m", api_key=first, status=503, started_at=now)
    make_usage(model="m", api_key=second, status=200, started_at=now - timedelta(days=3))
    client = staff_client()

    def rows(query: str) -> int:
        response = client.get(f"/admin/gateway/usagerecord/export.csv?{query}")
        return len(streamed(response).splitlines()) - 1

    today = now.date().isoformat()
    three_days_ago = (now - timedelta(days=3)).date().isoformat()
    assert rows("") == 3
    assert rows(f"day={today}") == 2
    assert rows(f"day={three_days_ago}") == 1
    assert rows("status_class=5") == 1
    assert rows(f"api_key__id__exact={second.pk}") == 1
    assert rows(f"day={today}&status_class=2&api_key__id__exact={first.pk}") == 1
    page = client.get("/admin/gateway/usagerecord/").content.decode()
    assert f"{first.prefix}… (alice)" in page and "5xx" in page and "today" in page


def test_the_admin_shows_spend_against_budget_per_key_user_and_team() -> None:
    from django.contrib.auth.models import Group

    from gateway.models import TeamLimits, UserLimits

    alice, bob = make_user("alice"), make_user("bob")
    _, first = make_key("alice", budget=1000, budget_period="day")
    _, second = make_key("alice")
    _, bobs = make_key("bob")
    for api_key in (first, second, bobs):
        make_usage(model="m", api_key=api_key)  # 10 + 20 tokens each
    UserLimits.objects.create(user=alice, token_budget=200, budget_period="month")
    team = Group.objects.create(name="ml")
    team.user_set.add(alice, bob)
    TeamLimits.objects.create(team=team, token_budget=500, budget_period="week")
    client = staff_client()

    keys = client.get("/admin/gateway/apikey/").content.decode()
    assert "30 of 1000 per day (3%)" in keys and "30 (no budget)" in keys
    users = client.get("/admin/gateway/userlimits/").content.decode()
    assert "60 of 200 per month (30%)" in users  # both of alice's keys
    teams = client.get("/admin/gateway/teamlimits/").content.decode()
    assert "90 of 500 per week (18%)" in teams  # every member's keys
