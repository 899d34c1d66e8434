"""Sign-in protection (django-axes): wrong passwords are counted per (account, address) and per
address, ten lock, the right password then fails from there until the lockout ends or an
administrator lifts it, and never from elsewhere; an account tried from many addresses is paced,
never locked for good; the attempts are in the admin; wrong admin-API tokens count in the same
ledger. One-time sign-in links: tests/site/test_signin_links.py."""

from __future__ import annotations

import io
import threading
from datetime import timedelta
from typing import Any

import pytest
from axes.models import AccessAttempt, AccessLog
from django.conf import settings
from django.core.management import call_command
from django.db.models import F
from django.test import Client
from django.utils import timezone

from gateway.identity import pacing
from gateway.models import SignInPace
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
def test_ten_wrong_passwords_lock_the_account_from_that_address_and_the_right_one_then_fails(
    url: str,
) -> None:
    make_user("root", superuser=True)
    statuses = fail(url, "root", 10)
    assert statuses[:9] == [200] * 9  # the form again, with its error
    assert statuses[9] == 429
    # The right password, from the same address: still locked; from another one: signed in
    # (an attacker's guesses never lock the owner out where the owner is).
    assert sign_in(url, "root", PASSWORD) == 429
    assert sign_in(url, "root", PASSWORD, address="10.9.9.9") == 302


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
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.0.0.2") == 429

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
    assert sign_in("/account/login/", "alice", PASSWORD, address="10.0.0.2") == 302
    # Successful sign-ins are logged too.
    assert AccessLog.objects.filter(username="alice").exists()
    assert "alice" in admin.get("/admin/axes/accesslog/").content.decode()


def test_a_lockout_is_lifted_from_the_command_line_too() -> None:
    make_user("alice")
    fail("/account/login/", "alice", 10)
    assert sign_in("/account/login/", "alice", PASSWORD) == 429
    call_command("axes_reset_username", "alice", stdout=io.StringIO())
    assert sign_in("/account/login/", "alice", PASSWORD) == 302


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


# --------------------------------------------------------------------------- lockout as an attack


def elapse(seconds: float) -> None:
    """The clock moves on by ``seconds``: every time the ledger holds goes back by as much
    (the ledger reads the time once per request, so this is the same as waiting)."""
    delta = timedelta(seconds=seconds)
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - delta)
    AccessLog.objects.update(attempt_time=F("attempt_time") - delta)
    SignInPace.objects.update(due_at=F("due_at") - delta)


def test_ten_wrong_passwords_for_admin_from_one_address_leave_it_open_from_another() -> None:
    make_user("admin", superuser=True)
    assert fail("/admin/login/", "admin", 10, address="203.0.113.66")[-1] == 429
    assert sign_in("/admin/login/", "admin", PASSWORD, address="203.0.113.66") == 429
    assert sign_in("/admin/login/", "admin", PASSWORD, address="10.0.0.7") == 302


def test_a_hundred_wrong_passwords_from_a_hundred_addresses_never_lock_the_owner_out() -> None:
    make_user("admin", superuser=True)
    statuses = []
    for i in range(100):
        address = f"198.51.100.{i + 1}"
        response = Client(REMOTE_ADDR=address).post(
            "/admin/login/", {"username": "admin", "password": f"guess-{i}"}
        )
        statuses.append(response.status_code)
        assert "_auth_user_id" not in response.client.session
    assert set(statuses) <= {200, 429}
    # The owner, from an address of their own: refused for a while at most, never for the
    # lockout's hour, and then in with the right password.
    owner = Client(REMOTE_ADDR="10.0.0.8")
    first = owner.post("/admin/login/", {"username": "admin", "password": PASSWORD})
    if first.status_code == 429:
        wait = int(first["Retry-After"])
        assert wait < settings.AXES_COOLOFF_TIME.total_seconds()
        elapse(wait)
        first = owner.post("/admin/login/", {"username": "admin", "password": PASSWORD})
    assert first.status_code == 302


def attempt(password: str, address: str, username: str = "admin") -> Any:
    """The response to one sign-in POST from ``address`` (with its ``client``)."""
    return Client(REMOTE_ADDR=address).post(
        "/admin/login/", {"username": username, "password": password}
    )


def spend_the_burst(username: str = "admin") -> int:
    """An attacker's wrong guesses from fresh addresses until the account is paced: how many
    were checked (the burst, less the attempts the account had already made)."""
    burst = 2 * settings.AXES_FAILURE_LIMIT
    for i in range(burst + 1):
        status = attempt("wrong", f"198.51.101.{i}", username).status_code
        if status == 429:
            return i
        assert status == 200
    raise AssertionError(f"{burst + 1} guesses from as many addresses and no pace")


def test_an_attacker_who_waits_as_told_gets_one_guess_per_pace_and_never_the_password() -> None:
    """A patient attacker from a hundred addresses: every guess is answered as a wrong one or
    a wait, never with a session, and a hundred of them take (100 - burst) paces of time."""
    make_user("admin", superuser=True)
    pace = settings.LLMGW_LOGIN_PACE.total_seconds()
    waited = 0.0
    checked = 0
    for i in range(100):
        address = f"198.51.100.{i + 1}"
        while True:
            response = attempt(f"guess-{i}", address)
            assert "_auth_user_id" not in response.client.session
            if response.status_code != 429:
                break
            wait = int(response["Retry-After"])
            assert 0 < wait <= pace
            elapse(wait)
            waited += wait
        assert response.status_code == 200  # the form again: a wrong password, nothing more
        checked += 1
    assert checked == 100
    assert waited >= (100 - 2 * settings.AXES_FAILURE_LIMIT - 1) * pace
    # Right after the attacker's last guess the owner waits one pace at most, then is in.
    owner = attempt(PASSWORD, "10.0.0.8")
    if owner.status_code == 429:
        assert int(owner["Retry-After"]) <= pace
        elapse(int(owner["Retry-After"]))
        owner = attempt(PASSWORD, "10.0.0.8")
    assert owner.status_code == 302


def without_the_wait(response: Any) -> bytes:
    """A paced sign-in's page with its wait (``Retry-After``, in the text too) taken out: the
    wait counts down with the clock, so two attempts a moment apart may say 300 and 299."""
    wait = response["Retry-After"].encode()
    page: bytes = response.content.replace(
        b"try again in %s second" % wait, b"try again in N second"
    )
    assert b"try again in N second" in page, "the page says how long to wait"
    return page


def test_the_right_password_during_the_pace_is_refused_like_a_wrong_one() -> None:
    make_user("admin", superuser=True)
    assert spend_the_burst() == 2 * settings.AXES_FAILURE_LIMIT
    right, wrong = attempt(PASSWORD, "198.51.102.1"), attempt("wrong", "198.51.102.2")
    assert right.status_code == wrong.status_code == 429
    assert without_the_wait(right) == without_the_wait(wrong)
    # The same wait, but for the time between the two attempts (the right one came first).
    pace = settings.LLMGW_LOGIN_PACE.total_seconds()
    assert 0 < int(wrong["Retry-After"]) <= int(right["Retry-After"]) <= pace
    assert "_auth_user_id" not in right.client.session
    assert "one sign-in attempt at a time" in right.content.decode()


def test_hammering_a_paced_account_does_not_push_its_owners_turn_away() -> None:
    make_user("admin", superuser=True)
    spend_the_burst()
    first_wait = int(attempt("wrong", "198.51.103.1")["Retry-After"])
    for i in range(50):  # refused attempts: none is counted
        assert attempt("wrong", f"198.51.103.{i + 2}").status_code == 429
    owner = attempt(PASSWORD, "10.0.0.8")
    assert owner.status_code == 429 and int(owner["Retry-After"]) <= first_wait
    elapse(first_wait)
    assert attempt(PASSWORD, "10.0.0.8").status_code == 302


def test_an_address_the_owner_signed_in_from_is_not_paced() -> None:
    make_user("admin", superuser=True)
    assert attempt(PASSWORD, "10.0.0.8").status_code == 302
    assert spend_the_burst() == 2 * settings.AXES_FAILURE_LIMIT - 1  # the owner took one
    assert attempt(PASSWORD, "10.0.0.8").status_code == 302
    assert attempt(PASSWORD, "10.0.0.9").status_code == 429  # a new address waits its turn


def test_ten_wrong_passwords_from_one_address_do_not_slow_the_account_elsewhere() -> None:
    make_user("admin", superuser=True)
    fail("/admin/login/", "admin", 10, address="203.0.113.66")
    fail("/admin/login/", "admin", 9, address="203.0.113.67")
    assert attempt(PASSWORD, "10.0.0.7").status_code == 302


def test_an_admin_token_is_not_slowed_by_the_pace_of_any_account() -> None:
    make_user("admin", superuser=True)
    good = tokens.issue("ops", scope=AdminToken.Scope.READ).token
    spend_the_burst()
    assert api_get(good, address="10.0.0.9") == (200, "")


def test_the_pace_lets_a_burst_through_then_one_attempt_per_interval() -> None:
    pace = pacing.Pace(interval=timedelta(seconds=300), burst=3)
    t0 = timezone.now()
    due = None
    for _ in range(3):
        due, wait = pacing.decide(due, t0, pace)
        assert due is not None and wait == timedelta(0)
    assert due == t0 + timedelta(seconds=900)
    assert pacing.decide(due, t0, pace) == (None, timedelta(seconds=300))
    assert pacing.decide(due, t0 + timedelta(seconds=299), pace) == (None, timedelta(seconds=1))
    later = t0 + timedelta(seconds=300)
    assert pacing.decide(due, later, pace) == (due + timedelta(seconds=300), timedelta(0))
    # Quiet for long enough, the whole burst is back; a time long past counts as none.
    idle = t0 + timedelta(hours=5)
    assert pacing.decide(due, idle, pace) == pacing.decide(None, idle, pace)
    assert pacing.decide(None, idle, pace) == (idle + timedelta(seconds=300), timedelta(0))


def test_a_claim_that_lost_a_race_reads_again_and_never_shares_a_slot() -> None:
    pace = pacing.Pace(interval=timedelta(seconds=300), burst=2)
    now = timezone.now()
    assert pacing.claim("admin", now, pace) == timedelta(0)
    assert pacing.claim("admin", now, pace) == timedelta(0)
    assert pacing.claim("admin", now, pace) == timedelta(seconds=300)
    assert SignInPace.objects.get(username="admin").due_at == now + timedelta(seconds=600)
    # Rows whose time has passed are dropped by the next claim, whoever it is for.
    assert pacing.claim("bob", now + timedelta(hours=1), pace) == timedelta(0)
    assert list(SignInPace.objects.values_list("username", flat=True)) == ["bob"]


@pytest.mark.django_db(transaction=True)
def test_claims_racing_from_many_addresses_at_once_take_one_slot_each() -> None:
    """Sixteen attempts at one instant for an account with a burst of five: five go ahead,
    whatever the interleaving (compare-and-set), and the rest are told to wait."""
    from django.db import connection

    pace = pacing.Pace(interval=timedelta(seconds=300), burst=5)
    now = timezone.now()
    start = threading.Barrier(16)
    waits: list[timedelta] = []

    def racer() -> None:
        try:
            start.wait()
            waits.append(pacing.claim("admin", now, pace))
        finally:
            connection.close()

    threads = [threading.Thread(target=racer) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(waits) == 16
    assert sum(1 for w in waits if w == timedelta(0)) == 5
    assert SignInPace.objects.get(username="admin").due_at == now + 5 * pace.interval
