"""/account/: a user's own keys and usage, and nothing of anyone else's (G3, A1, A2, A6)."""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from gateway.identity.keys import KEY_PREFIX, hash_key
from gateway.models import ApiKey
from tests.harness.factories import PASSWORD, make_key, make_usage, make_user

pytestmark = pytest.mark.django_db

KEY_RE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}")


def signed_in(username: str) -> Client:
    client = Client()
    client.force_login(make_user(username))
    return client


def streamed(response):
    return b"".join(response.streaming_content).decode()


@pytest.mark.parametrize("path", ["/account/", "/account/usage.csv"])
def test_account_pages_without_a_session_redirect_to_the_account_login(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/account/login/?next=")


def test_posts_without_a_session_change_nothing() -> None:
    make_user("alice")
    _, key = make_key("alice")
    assert Client().post("/account/keys/", {"name": "x"}).status_code == 302
    assert Client().post(f"/account/keys/{key.pk}/revoke/").status_code == 302
    assert ApiKey.objects.count() == 1 and ApiKey.objects.get().revoked_at is None


def test_a_user_signs_in_with_a_password_and_lands_on_their_account() -> None:
    make_user("alice")
    client = Client(enforce_csrf_checks=True)
    page = client.get("/account/login/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token is not None
    response = client.post(
        "/account/login/",
        {"username": "alice", "password": PASSWORD, "csrfmiddlewaretoken": token.group(1)},
    )
    assert response.status_code == 302 and response["Location"] == "/account/"
    assert "alice · llmgw" in client.get("/account/").content.decode()


def test_a_wrong_password_is_refused() -> None:
    make_user("alice")
    response = Client().post("/account/login/", {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert "didn't match" in response.content.decode()


def test_a_new_key_is_shown_once_and_only_its_hash_is_kept() -> None:
    client = signed_in("alice")
    response = client.post("/account/keys/", {"name": "laptop", "expires_in_days": "30"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    found = set(KEY_RE.findall(response.content.decode()))
    assert len(found) == 1
    key = found.pop()
    row = ApiKey.objects.get()
    assert row.user.username == "alice" and row.name == "laptop"
    assert row.key_hash == hash_key(key) and row.expires_at is not None
    overview = client.get("/account/").content.decode()
    assert key not in overview
    assert f"{row.prefix}…" in overview


def test_key_creation_and_revocation_need_the_csrf_token() -> None:
    make_user("alice")
    _, key = make_key("alice")
    client = Client(enforce_csrf_checks=True)
    client.force_login(key.user)
    assert client.post("/account/keys/", {"name": "x"}).status_code == 403
    assert client.post(f"/account/keys/{key.pk}/revoke/").status_code == 403
    assert ApiKey.objects.count() == 1 and ApiKey.objects.get().revoked_at is None


def test_a_user_revokes_their_own_key() -> None:
    make_user("alice")
    _, key = make_key("alice")
    client = Client()
    client.force_login(key.user)
    response = client.post(f"/account/keys/{key.pk}/revoke/")
    assert response.status_code == 302
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert "revoked" in client.get("/account/").content.decode()


def test_revoking_someone_elses_key_is_404_and_changes_nothing() -> None:
    make_user("bob")
    _, bobs = make_key("bob")
    client = signed_in("alice")
    assert client.post(f"/account/keys/{bobs.pk}/revoke/").status_code == 404
    assert client.post("/account/keys/999999/revoke/").status_code == 404
    assert ApiKey.objects.get(pk=bobs.pk).revoked_at is None


def test_the_account_page_shows_only_the_users_own_keys_and_usage() -> None:
    make_user("alice")
    make_user("bob")
    _, alices = make_key("alice", name="alice-laptop")
    _, bobs = make_key("bob", name="bob-secret-project")
    make_usage(model="alice-model", api_key=alices, prompt_tokens=111, cached_tokens=96)
    make_usage(model="bob-model", api_key=bobs, prompt_tokens=999)
    client = Client()
    client.force_login(alices.user)
    page = client.get("/account/").content.decode()
    assert alices.prefix in page and "alice-laptop" in page and "alice-model" in page
    assert bobs.prefix not in page
    assert "bob-secret-project" not in page and "bob-model" not in page
    # The prompt tokens her engines found cached, in the per-model table and the latest rows.
    assert page.count('<td class="lg-num">96</td>') == 2

    chart = re.search(r'<script id="lg-usage-data" type="application/json">(.*?)</script>', page)
    assert chart is not None
    data = json.loads(chart.group(1))
    assert len(data["labels"]) == len(data["tokens"]) == 30
    assert data["tokens"][-1] == 111 + 20 and data["requests"][-1] == 1  # hers only, today

    csv = streamed(client.get("/account/usage.csv"))
    assert "alice-model" in csv and "bob-model" not in csv and bobs.prefix not in csv


def test_a_non_staff_user_cannot_reach_admin_data_or_other_accounts() -> None:
    make_user("bob")
    _, bobs = make_key("bob")
    make_usage(model="bob-model", api_key=bobs)
    client = signed_in("alice")
    for path in (
        "/admin/",
        "/admin/gateway/apikey/",
        f"/admin/gateway/apikey/{bobs.pk}/change/",
        "/admin/gateway/usagerecord/",
        "/admin/gateway/usagerecord/export.csv",
    ):
        response = client.get(path)
        assert response.status_code == 302, path
        assert response["Location"].startswith("/admin/login/"), path
    assert client.get("/admin/dashboard.json").status_code == 403


def test_active_keys_are_capped_per_user() -> None:
    from gateway.identity import account

    make_user("alice")
    for _ in range(account.MAX_ACTIVE_KEYS):
        _, key = make_key("alice")
    client = Client()
    client.force_login(key.user)
    response = client.post("/account/keys/", {"name": "one too many"}, follow=True)
    assert "revoke one first" in response.content.decode()
    assert ApiKey.objects.count() == account.MAX_ACTIVE_KEYS


def test_sign_out_needs_a_post_and_ends_the_session() -> None:
    client = signed_in("alice")
    assert client.get("/account/logout/").status_code == 405
    assert client.post("/account/logout/").status_code == 302
    assert client.get("/account/").status_code == 302


# --------------------------------------------------------------------------- people's limits


def limited_user(username: str, **limits: object) -> Client:
    from gateway.models import UserLimits

    client = signed_in(username)
    UserLimits.objects.create(user=get_user_model().objects.get(username=username), **limits)
    return client


def loaded(prefix: str) -> object:
    from gateway.identity import keys

    return keys._load(ApiKey.objects.get(prefix=prefix).key_hash)


def test_a_key_made_at_account_inherits_its_owners_limits() -> None:
    """Failure 5: a user given one model and a budget made a key that could use every model
    with no limit at all."""
    from gateway.models import TeamLimits

    client = limited_user("alice", allowed_models=["small"], token_budget=1000, rpm_limit=5)
    from django.contrib.auth.models import Group

    team = Group.objects.create(name="ml")
    team.user_set.add(get_user_model().objects.get(username="alice"))
    TeamLimits.objects.create(team=team, tpm_limit=500)
    page = client.post("/account/keys/", {"name": "laptop"}).content.decode()
    match = KEY_RE.search(page)
    assert match is not None
    info = loaded(match.group(0)[:14])
    assert info.may_use("small") and not info.may_use("large")  # type: ignore[attr-defined]
    scopes = {s.name.split(":")[0]: s for s in info.scopes}  # type: ignore[attr-defined]
    assert set(scopes) == {"user", "team"}  # the key sets nothing of its own
    assert (scopes["user"].token_budget, scopes["user"].rpm_limit) == (1000, 5)
    assert scopes["team"].tpm_limit == 500


def test_a_key_made_at_account_can_only_narrow_its_owners_limits() -> None:
    client = limited_user("alice", allowed_models=["small"], token_budget=1000)
    response = client.post(
        "/account/keys/", {"name": "x", "models": "small, large", "token_budget": "5000"}
    )
    assert response.status_code == 302
    assert not ApiKey.objects.exists()
    shown = client.get("/account/").content.decode()
    assert "not large" in shown and "token budget 5000 is above your account" in shown
    page = client.post(
        "/account/keys/", {"name": "y", "models": "small", "token_budget": "10"}
    ).content.decode()
    key = ApiKey.objects.get()
    assert KEY_RE.search(page) and (key.allowed_models, key.token_budget) == (["small"], 10)


def test_staff_can_turn_self_service_off() -> None:
    client = limited_user("alice", self_service=False)
    assert "turned off making keys" in client.get("/account/").content.decode()
    client.post("/account/keys/", {"name": "x"})
    assert not ApiKey.objects.exists()


def test_the_account_page_shows_the_users_limits_and_what_is_left() -> None:
    client = limited_user("alice", token_budget=1000, rpm_limit=7)
    _, key = make_key("alice")
    make_usage(model="m", api_key=key, prompt_tokens=100, completion_tokens=150)
    page = client.get("/account/").content.decode()
    limits_table = page[page.index('id="lg-limits"') :]
    assert "your account" in limits_table and "1000 per month" in limits_table
    assert ">250<" in limits_table and ">750<" in limits_table  # spent, left
