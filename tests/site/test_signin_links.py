"""One-time sign-in links (``manage.py signin_link``): the way in for an administrator whose
password sign-in is locked or paced. A link signs in its one user, once, within its lifetime,
from any address (locked or not); only its hash is stored; printing and use are Events."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from control.models import Event
from gateway.identity import signin_links
from gateway.models import SignInLink
from tests.harness.factories import PASSWORD, make_user

pytestmark = pytest.mark.django_db


def print_link(username: str, *options: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "signin_link", username, "--base", "http://testserver", *options, stdout=out, stderr=err
    )
    assert "good once" in err.getvalue()
    return out.getvalue().strip().removeprefix("http://testserver")


def use(path: str, *, address: str = "10.0.0.1") -> tuple[Client, int]:
    client = Client(REMOTE_ADDR=address)
    return client, client.post(path).status_code


def signed_in_as(client: Client) -> str | None:
    user_id = client.session.get("_auth_user_id")
    return None if user_id is None else User.objects.get(pk=user_id).username


def test_a_printed_link_signs_its_user_in_once_and_then_never_again() -> None:
    make_user("admin", superuser=True)
    make_user("alice")
    path = print_link("admin")
    token = path.split("/")[-2]
    assert path == f"/account/link/{token}/"
    # Stored as a hash only.
    row = SignInLink.objects.get()
    assert row.token_hash == signin_links.hash_token(token) and token not in row.token_hash
    # Opening it shows whom it signs in and uses nothing up (a mail scanner may fetch it).
    for _ in range(2):
        page = Client().get(path)
        assert page.status_code == 200 and page["Cache-Control"] == "no-store"
        assert 'id="lg-link-user">admin<' in page.content.decode()
    client, status = use(path)
    assert status == 302 and signed_in_as(client) == "admin"
    assert client.get("/admin/").status_code == 200
    # Used: refused, to anybody, the same way as a link never issued.
    again, status = use(path, address="10.0.0.2")
    assert status == 410 and signed_in_as(again) is None
    assert Client().get(path).status_code == 410
    assert use("/account/link/" + "x" * 43 + "/")[1] == 410
    subjects = list(Event.objects.filter(subject="user/admin").values_list("message", flat=True))
    assert any("one-time sign-in link printed by cli" in m for m in subjects)
    assert any("signed in with a one-time sign-in link from 10.0.0.1" in m for m in subjects)


def test_a_link_expires() -> None:
    make_user("admin", superuser=True)
    now = timezone.now()
    issued = signin_links.issue("admin", actor="test", lifetime=timedelta(minutes=15), now=now)
    end = now + timedelta(minutes=15)
    assert signin_links.peek(issued.token, now=end - timedelta(seconds=1)) is not None
    assert signin_links.redeem(issued.token, address="x", now=end) is None
    assert signin_links.redeem(issued.token, address="x", now=end + timedelta(days=1)) is None
    # As the view sees it, on the real clock: printed 16 minutes ago, good for 15.
    stale = signin_links.issue("admin", actor="test", now=now - timedelta(minutes=16))
    client, status = use(stale.path)
    assert status == 410 and signed_in_as(client) is None
    assert SignInLink.objects.filter(used_at__isnull=False).count() == 0


def test_a_link_works_from_an_address_locked_out_by_wrong_passwords() -> None:
    make_user("admin", superuser=True)
    for _ in range(10):
        Client(REMOTE_ADDR="10.6.6.6").post(
            "/admin/login/", {"username": "admin", "password": "wrong"}
        )
    locked = Client(REMOTE_ADDR="10.6.6.6").post(
        "/admin/login/", {"username": "admin", "password": PASSWORD}
    )
    assert locked.status_code == 429
    client, status = use(print_link("admin"), address="10.6.6.6")
    assert status == 302 and signed_in_as(client) == "admin"


def test_a_link_signs_in_only_its_own_user_and_a_new_one_ends_the_last() -> None:
    make_user("alice")
    make_user("bob")
    first = print_link("alice")
    second = print_link("alice")
    assert use(first)[1] == 410  # ended by the second
    client, status = use(second)
    assert status == 302 and signed_in_as(client) == "alice"
    tampered = second[:-3] + ("A" if second[-3] != "A" else "B") + "/"
    assert use(tampered)[1] == 410


def test_a_link_for_a_deactivated_user_is_refused_before_and_after_printing() -> None:
    user = make_user("alice")
    path = print_link("alice")
    user.is_active = False
    user.save()
    assert use(path)[1] == 410
    with pytest.raises(CommandError, match="deactivated"):
        print_link("alice")
    with pytest.raises(CommandError, match="no user"):
        print_link("nobody")
    with pytest.raises(CommandError, match="24 hours"):
        print_link("alice", "--minutes", "0")


def test_a_session_from_a_link_holds_with_passwords_turned_off(settings: Any) -> None:
    make_user("admin", superuser=True)
    settings.LLMGW_PASSWORD_LOGIN = False
    settings.AUTHENTICATION_BACKENDS = [
        b for b in settings.AUTHENTICATION_BACKENDS if not b.endswith("ModelBackend")
    ]
    client, status = use(print_link("admin"))
    assert status == 302
    assert client.get("/admin/").status_code == 200
