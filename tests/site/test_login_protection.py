"""Sign-in protection (django-axes): wrong passwords are counted per account and per address,
ten lock, the right password then fails until the lockout ends or an administrator lifts it;
the attempts are in the admin; wrong admin-API tokens count in the same ledger."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from axes.models import AccessAttempt, AccessLog
from django.conf import settings
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from tests.harness.factories import PASSWORD, make_user

pytestmark = pytest.mark.django_db

LOGINS = ["/admin/login/", "/account/login/"]


def sign_in(url: str, username: str, password: str, *, address: str = "10.0.0.1") -> int:
    """The status of one sign-in POST (302: signed in; 200: the form again; 429: locked)."""
    response = Client(REMOTE_ADDR=address).post(url, {"username": username, "password": password})
    return response.status_code


def fail(url: str, username: str, times: int, *, address: str = "10.0.0.1") -> list[int]:
    return [sign_in(url, username, "wrong", address=address) for _ in range(times)]


def test_the_default_limit_is_ten() -> None:
    assert settings.AXES_FAILURE_LIMIT == 10


@pytest.mark.parametrize("url", LOGINS)
def test_ten_wrong_passwords_lock_the_account_and_the_right_one_then_fails(url: str) -> None:
    make_user("root", superuser=True)
    statuses = fail(url, "root", 10)
    assert statuses[:9] == [200] * 9  # the form again, with its error
    assert statuses[9] == 429
    # The right password, from the same address and from another one: still locked.
    assert sign_in(url, "root", PASSWORD) == 429
    assert sign_in(url, "root", PASSWORD, address="10.9.9.9") == 429


def test_nine_wrong_passwords_then_the_right_one_signs_in_and_resets_the_count() -> None:
    make_user("root", superuser=True)
    fail("/admin/login/", "root", 9)
    assert sign_in("/admin/login/", "root", PASSWORD) == 302
    assert fail("/admin/login/", "root", 9) == [200] * 9  # counting starts again


def test_ten_wrong_passwords_from_one_address_lock_that_address_for_every_account() -> None:
    make_user("alice")
    for i in range(10):
        sign_in("/account/login/", f"guess-{i}", "wrong", address="10.6.6.6")
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.6.6.6") == 429
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.7.7.7") == 302


def test_the_lockout_ends_after_the_cool_off() -> None:
    make_user("root", superuser=True)
    fail("/admin/login/", "root", 10)
    assert sign_in("/admin/login/", "root", PASSWORD) == 429
    past = timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    AccessAttempt.objects.update(attempt_time=past)
    assert sign_in("/admin/login/", "root", PASSWORD) == 302


def test_an_administrator_sees_the_attempts_and_lifts_the_lockout_in_the_admin() -> None:
    make_user("alice")
    fail("/account/login/", "alice", 10, address="10.0.0.2")
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.0.0.3") == 429

    admin = Client()
    admin.force_login(make_user("root", superuser=True))
    page = admin.get("/admin/axes/accessattempt/").content.decode()
    assert "alice" in page and "10.0.0.2" in page
    attempts = AccessAttempt.objects.filter(username="alice")
    assert sum(a.failures_since_start for a in attempts) >= 10
    admin.post(
        "/admin/axes/accessattempt/",
        {
            "action": "delete_selected",
            "_selected_action": [str(a.pk) for a in attempts],
            "post": "yes",
        },
    )
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.0.0.3") == 302
    # Successful sign-ins are logged too.
    assert AccessLog.objects.filter(username="alice").exists()
    assert "alice" in admin.get("/admin/axes/accesslog/").content.decode()


def test_a_lockout_is_lifted_from_the_command_line_too() -> None:
    make_user("alice")
    fail("/account/login/", "alice", 10)
    call_command("axes_reset_username", "alice", stdout=io.StringIO())
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.0.0.5") == 302


def test_the_lockout_page_says_what_happened_without_a_stack_trace() -> None:
    make_user("root", superuser=True)
    fail("/admin/login/", "root", 10)
    response = Client(REMOTE_ADDR="10.0.0.1").post(
        "/admin/login/", {"username": "root", "password": PASSWORD}
    )
    assert response.status_code == 429
    text = response.content.decode()
    assert "Too many failed sign-ins" in text and "Traceback" not in text


# --------------------------------------------------------------------------- the admin API


def api_get(token: str, *, address: str = "10.0.0.1") -> tuple[int, str]:
    response = Client(REMOTE_ADDR=address, HTTP_AUTHORIZATION=f"Bearer {token}").get(
        "/api/admin/v1/lease"
    )
    return response.status_code, response.json()["error"][
        "code"
    ] if response.status_code >= 400 else ""


def test_wrong_admin_tokens_lock_the_address_out_of_the_api() -> None:
    good = tokens.issue("ci", scope=AdminToken.Scope.READ).token
    wrong = [tokens.TOKEN_PREFIX + f"{i:02d}" + "x" * 41 for i in range(10)]
    # As with passwords, the tenth failure is answered with the lockout itself.
    assert [api_get(t)[0] for t in wrong] == [401] * 9 + [429]
    assert api_get(good) == (429, "locked_out")  # even the right token, from there
    assert api_get(good, address="10.0.0.9") == (200, "")
    attempts = AccessAttempt.objects.filter(ip_address="10.0.0.1")
    assert attempts.count() == 10
    # The ledger holds the token's visible prefix, never the secret part.
    assert all(a.username.startswith("admin-token:llmgw-admin-") for a in attempts)
    assert not any(w[len(tokens.TOKEN_PREFIX) + 8 :] in a.username for w in wrong for a in attempts)
    call_command("axes_reset_ip", "10.0.0.1", stdout=io.StringIO())
    assert api_get(good) == (200, "")


def test_wrong_tokens_with_a_real_tokens_prefix_from_many_addresses_do_not_lock_it_out() -> None:
    """The visible prefix is no secret: counting failures per prefix would let anyone who knows
    it lock the real token out. Each address is counted on its own."""
    good = tokens.issue("ci", scope=AdminToken.Scope.READ).token
    prefix = good[: tokens.VISIBLE_CHARS]
    wrong = [prefix + f"{i:02d}" + "y" * (len(good) - len(prefix) - 2) for i in range(12)]
    assert [api_get(t, address=f"10.1.0.{i}")[0] for i, t in enumerate(wrong)] == [401] * 12
    assert api_get(good, address="10.2.0.1") == (200, "")


def test_behind_a_proxy_the_address_is_the_one_the_proxy_appended(settings: object) -> None:
    from django.test import RequestFactory

    from llmgw_site.signin import client_ip

    request = RequestFactory().get(
        "/", REMOTE_ADDR="10.0.0.254", HTTP_X_FORWARDED_FOR="6.6.6.6, 203.0.113.7"
    )
    assert client_ip(request) == "10.0.0.254"  # the header is not trusted unless named
    settings.LLMGW_CLIENT_IP_HEADER = "X-Forwarded-For"  # type: ignore[attr-defined]
    assert client_ip(request) == "203.0.113.7"  # not the forged 6.6.6.6
