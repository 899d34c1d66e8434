"""Single sign-on against a real OpenID Connect provider process (tests/harness/oidc_provider):
discovery, the authorization code flow with PKCE and a nonce, signed ID tokens checked against
the provider's JWKS, users created on first sign-in with staff and teams from the group claim,
local accounts never taken over, local passwords that can be turned off; and a real headless
Chromium that signs in through the provider and lands on the dashboard (staff) or on
``/account/`` (everybody else)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from django.contrib.auth.models import Group, User
from django.core.exceptions import SuspiciousOperation
from django.core.management import CommandError, call_command
from django.test import Client

from control.models import Event
from gateway.identity import people
from gateway.models import SsoIdentity, SsoLinkName
from llmgw_site import sso
from tests.harness.browser import Browser
from tests.harness.factories import PASSWORD, make_user
from tests.harness.live import start_web
from tests.harness.procs import PYTHON, Proc, free_port
from tests.harness.waits import wait_until

CLIENT_ID, CLIENT_SECRET = "llmgw", "test-client-secret"
USERS: dict[str, dict[str, Any]] = {
    "carol": {"password": "carol-pw", "groups": ["llmgw-admins", "research"]},
    "dave": {"password": "dave-pw", "groups": ["research", "not-a-team"], "email_verified": True},
    "root": {"password": "root-pw", "groups": ["llmgw-admins"]},
    # People at a provider where users choose their own names and emails.
    "mallory": {"password": "mallory-pw", "preferred_username": "alice"},
    "eve": {
        "password": "eve-pw",
        "preferred_username": None,
        "email": "bob@example.com",
        "email_verified": False,
    },
    "robert": {"password": "robert-pw", "email": "bob@example.com", "email_verified": True},
    "twin": {"password": "twin-pw", "email": "bob@example.com", "email_verified": True},
    "erin": {"password": "erin-pw"},
    # Erin again, after renaming herself at the provider: the same subject.
    "erin-renamed": {
        "password": "erin-pw",
        "sub": "sub-erin",
        "preferred_username": "erin2",
        "email": "erin2@example.com",
    },
}


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("oidc")
    users = home / "users.json"
    users.write_text(json.dumps(USERS))
    port = free_port()
    argv = [
        PYTHON, "-m", "tests.harness.oidc_provider", "--port", str(port),
        "--users", str(users), "--client", f"{CLIENT_ID}:{CLIENT_SECRET}",
    ]  # fmt: skip
    proc = Proc("oidc-provider", argv, home, port=port).start().wait_listening()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def sso_env(issuer: str) -> dict[str, str]:
    return {
        "LLMGW_OIDC_ISSUER": issuer,
        "LLMGW_OIDC_CLIENT_ID": CLIENT_ID,
        "LLMGW_OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "LLMGW_OIDC_STAFF_GROUPS": "llmgw-admins",
    }


@pytest.fixture
def sso_on(settings: Any, provider: str) -> str:
    settings.LLMGW_OIDC_ISSUER = provider
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.LLMGW_OIDC_STAFF_GROUPS = ["llmgw-admins"]
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, "llmgw_site.sso.Backend"]
    sso.forget_discovery()
    return provider


def sign_in(client: Client, username: str, password: str) -> httpx.Response:
    """The code flow as a browser walks it: llmgw -> the provider's form -> back to llmgw.
    Returns the provider's answer to the form (a redirect back, or a refusal)."""
    start = client.get("/oidc/authenticate/")
    assert start.status_code == 302, start.content
    authorize = urlparse(start["Location"])
    query = {k: v[0] for k, v in parse_qs(authorize.query).items()}
    assert query["code_challenge_method"] == "S256" and query["nonce"] and query["state"]
    form = httpx.post(
        f"{authorize.scheme}://{authorize.netloc}{authorize.path}",
        data={**query, "username": username, "password": password},
        follow_redirects=False,
    )
    return form


def finish(client: Client, answer: httpx.Response) -> str:
    """Follow the provider's redirect back into llmgw; where the browser ends up."""
    back = urlparse(answer.headers["location"])
    response = client.get(back.path, parse_qs(back.query))
    hops = 0
    while response.status_code == 302 and hops < 5 and response["Location"].startswith("/"):
        location = response["Location"]
        if location in {"/admin/", "/account/"} or location.startswith("/account/login/"):
            return location
        response = client.get(location)
        hops += 1
    return response["Location"] if response.status_code == 302 else str(response.status_code)


@pytest.mark.django_db
def test_a_staff_group_member_is_created_as_staff_with_teams_and_lands_on_the_dashboard(
    sso_on: str,
) -> None:
    Group.objects.create(name="research")
    client = Client()
    assert finish(client, sign_in(client, "carol", "carol-pw")) == "/admin/"
    carol = User.objects.get(username="carol")
    assert carol.is_staff and not carol.is_superuser and not carol.has_usable_password()
    assert [g.name for g in carol.groups.all()] == ["research"]  # llmgw-admins is a role
    assert carol.email == "carol@example.com"
    assert client.get("/admin/").status_code == 200


@pytest.mark.django_db
def test_a_user_without_a_staff_group_lands_on_the_account_page(sso_on: str) -> None:
    Group.objects.create(name="research")
    client = Client()
    assert finish(client, sign_in(client, "dave", "dave-pw")) == "/account/"
    dave = User.objects.get(username="dave")
    assert not dave.is_staff and [g.name for g in dave.groups.all()] == ["research"]
    assert not Group.objects.filter(name="not-a-team").exists()
    assert client.get("/account/").status_code == 200


@pytest.mark.django_db
def test_roles_follow_the_provider_on_every_sign_in(sso_on: str, settings: Any) -> None:
    client = Client()
    finish(client, sign_in(client, "carol", "carol-pw"))
    assert User.objects.get(username="carol").is_staff
    settings.LLMGW_OIDC_STAFF_GROUPS = ["someone-else"]
    settings.LLMGW_OIDC_CREATE_TEAMS = True
    again = Client()
    assert finish(again, sign_in(again, "carol", "carol-pw")) == "/account/"
    carol = User.objects.get(username="carol")
    assert not carol.is_staff
    assert sorted(g.name for g in carol.groups.all()) == ["llmgw-admins", "research"]
    assert User.objects.filter(username="carol").count() == 1


@pytest.mark.django_db
def test_a_local_account_is_never_taken_over_by_a_sign_in_that_claims_its_name(
    sso_on: str,
) -> None:
    make_user("root", superuser=True)
    client = Client()
    assert finish(client, sign_in(client, "root", "root-pw")) == "/account/login/?sso=failed"
    assert "_auth_user_id" not in client.session
    assert User.objects.get(username="root").has_usable_password()


@pytest.mark.django_db
def test_a_user_provisioned_by_the_api_without_a_password_signs_in_by_sso(sso_on: str) -> None:
    # As POST /api/admin/v1/users does; the provider vouches for dave's email.
    people.create_user("dave", email="dave@example.com", actor="token:ops")
    client = Client()
    assert finish(client, sign_in(client, "dave", "dave-pw")) == "/account/"
    assert User.objects.filter(username="dave").count() == 1
    assert SsoIdentity.objects.get().user.username == "dave"


@pytest.mark.django_db
def test_a_provisioned_account_is_linked_by_no_name_until_an_operator_sets_one(
    sso_on: str,
) -> None:
    people.create_user("mallorys-target", actor="token:ops")
    people.create_user("alice", actor="token:ops")  # no email: nothing vouches for anyone
    client = Client()
    assert finish(client, sign_in(client, "mallory", "mallory-pw")) == "/account/login/?sso=failed"
    assert signed_in_as(client) is None and not SsoIdentity.objects.exists()
    # The operator says which provider name is alice's: "carol" (not the name "alice").
    call_command("set_user", "alice", "--sso-username", "carol", stdout=io.StringIO())
    assert SsoLinkName.objects.get().user.username == "alice"
    carol = Client()
    finish(carol, sign_in(carol, "carol", "carol-pw"))
    assert signed_in_as(carol) == "alice"
    assert not SsoLinkName.objects.exists()  # used up: the binding decides from now on
    assert SsoIdentity.objects.get(user__username="alice").subject == "sub-carol"
    mallory = Client()
    finish(mallory, sign_in(mallory, "mallory", "mallory-pw"))
    assert signed_in_as(mallory) is None
    assert any(
        "linked by the provider name 'carol'" in m
        for m in Event.objects.filter(subject="user/alice").values_list("message", flat=True)
    )


@pytest.mark.django_db
def test_a_provider_name_is_set_only_on_an_account_without_a_password() -> None:
    make_user("root", superuser=True)
    with pytest.raises(people.PersonInvalid, match="has a password"):
        people.create_user("x", actor="t", password="a-long-password-1", sso_username="x")
    with pytest.raises(CommandError, match="has a password"):
        call_command("set_user", "root", "--sso-username", "root", stdout=io.StringIO())
    people.create_user("a", actor="t", sso_username="shared")
    with pytest.raises(people.Conflict, match="another account"):
        people.create_user("b", actor="t", sso_username="shared")
    assert not User.objects.filter(username="b").exists()  # all or nothing


def signed_in_as(client: Client) -> str | None:
    user_id = client.session.get("_auth_user_id")
    return None if user_id is None else User.objects.get(pk=user_id).username


@pytest.mark.django_db
def test_another_subject_claiming_alices_name_never_gets_alices_account(sso_on: str) -> None:
    people.create_user("alice", actor="token:ops")  # provisioned, never signed in
    client = Client()
    finish(client, sign_in(client, "mallory", "mallory-pw"))  # preferred_username "alice"
    assert signed_in_as(client) != "alice"
    assert User.objects.filter(username="alice").count() == 1
    # Refused: the name is another account's, and nothing links mallory to it.
    assert signed_in_as(client) is None
    assert not SsoIdentity.objects.filter(user__username="alice").exists()


@pytest.mark.django_db
def test_an_unverified_email_of_bob_never_gets_bobs_account(sso_on: str) -> None:
    # Provisioned under his email address, as many operators name people.
    people.create_user("bob@example.com", email="bob@example.com", actor="token:ops")
    client = Client()
    finish(client, sign_in(client, "eve", "eve-pw"))  # no name, bob's email, unverified
    assert signed_in_as(client) != "bob@example.com"
    assert not SsoIdentity.objects.filter(user__username="bob@example.com").exists()
    # Bob himself, whose email the provider vouches for, gets his account.
    people.create_user("bob", email="bob@example.com", actor="token:ops")
    User.objects.filter(username="bob@example.com").delete()
    robert = Client()
    finish(robert, sign_in(robert, "robert", "robert-pw"))
    assert signed_in_as(robert) == "bob"


@pytest.mark.django_db
def test_a_verified_email_links_a_provisioned_account_once_then_the_binding_is_used(
    sso_on: str,
) -> None:
    people.create_user("bob", email="bob@example.com", actor="token:ops")
    client = Client()
    assert finish(client, sign_in(client, "robert", "robert-pw")) == "/account/"
    assert signed_in_as(client) == "bob"
    again = Client()
    finish(again, sign_in(again, "robert", "robert-pw"))
    assert signed_in_as(again) == "bob"
    # Another subject with the same verified email: the account is linked already.
    twin = Client()
    finish(twin, sign_in(twin, "twin", "twin-pw"))
    assert signed_in_as(twin) != "bob"
    assert signed_in_as(twin) == "twin"  # a new account of its own, its name being free
    assert list(
        SsoIdentity.objects.filter(user__username="bob").values_list("subject", flat=True)
    ) == ["sub-robert"]


@pytest.mark.django_db
def test_the_same_subject_with_a_changed_name_and_email_keeps_its_own_account(
    sso_on: str,
) -> None:
    client = Client()
    finish(client, sign_in(client, "erin", "erin-pw"))
    assert signed_in_as(client) == "erin"
    renamed = Client()
    finish(renamed, sign_in(renamed, "erin-renamed", "erin-pw"))
    assert signed_in_as(renamed) == "erin"
    assert not User.objects.filter(username="erin2").exists()


@pytest.mark.django_db
def test_wrong_passwords_for_an_account_never_slow_its_single_sign_on(
    sso_on: str, settings: Any
) -> None:
    first = Client()
    finish(first, sign_in(first, "dave", "dave-pw"))
    for i in range(2 * settings.AXES_FAILURE_LIMIT):
        Client(REMOTE_ADDR=f"198.51.100.{i}").post(
            "/account/login/", {"username": "dave", "password": "guess"}
        )
    paced = Client(REMOTE_ADDR="198.51.100.250").post(
        "/account/login/", {"username": "dave", "password": "guess"}
    )
    assert paced.status_code == 429
    again = Client(REMOTE_ADDR="198.51.100.251")
    assert finish(again, sign_in(again, "dave", "dave-pw")) == "/account/"
    assert signed_in_as(again) == "dave"


@pytest.mark.django_db
def test_a_wrong_password_at_the_provider_signs_nobody_in(sso_on: str) -> None:
    client = Client()
    assert sign_in(client, "carol", "wrong").status_code == 401
    assert not User.objects.filter(username="carol").exists()


@pytest.mark.django_db
def test_a_replayed_callback_is_refused(sso_on: str) -> None:
    client = Client()
    answer = sign_in(client, "dave", "dave-pw")
    assert finish(client, answer) == "/account/"
    thief = Client()
    back = urlparse(answer.headers["location"])
    response = thief.get(back.path, parse_qs(back.query))
    assert response.status_code in {302, 400}
    assert "_auth_user_id" not in thief.session


@pytest.mark.django_db
def test_sso_is_off_by_default(settings: Any) -> None:
    settings.LLMGW_OIDC_ISSUER = ""
    assert Client().get("/oidc/authenticate/").status_code == 404
    assert Client().get("/oidc/callback/?code=x&state=y").status_code == 404
    page = Client().get("/account/login/").content.decode()
    assert 'id="lg-sso"' not in page and 'id="id_password"' in page


@pytest.mark.django_db
def test_the_sign_in_pages_offer_sso_when_it_is_on(sso_on: str) -> None:
    for url in ("/account/login/", "/admin/login/"):
        page = Client().get(url).content.decode()
        assert 'id="lg-sso"' in page and 'id="id_password"' in page, url


@pytest.mark.django_db
def test_local_passwords_can_be_turned_off(sso_on: str, settings: Any) -> None:
    make_user("alice")
    settings.LLMGW_PASSWORD_LOGIN = False
    settings.AUTHENTICATION_BACKENDS = [
        b for b in settings.AUTHENTICATION_BACKENDS if not b.endswith("ModelBackend")
    ]
    page = Client().get("/account/login/").content.decode()
    assert 'id="lg-sso"' in page and 'id="id_password"' not in page
    assert 'id="id_password"' not in Client().get("/admin/login/").content.decode()
    posted = Client().post("/account/login/", {"username": "alice", "password": PASSWORD})
    assert posted.status_code == 200  # the page again: nobody signed in
    assert "_auth_user_id" not in posted.client.session
    client = Client()
    assert finish(client, sign_in(client, "dave", "dave-pw")) == "/account/"


# --------------------------------------------------------------------------- the checks, alone


def test_roles_from_groups() -> None:
    roles = sso.roles_from_groups(
        ["ops", "research", "x"],
        staff_groups=["ops"],
        superuser_groups=["root"],
        teams=["research", "sales"],
    )
    assert roles == sso.Roles(is_staff=True, is_superuser=False, teams=frozenset({"research"}))
    boss = sso.roles_from_groups(["root"], staff_groups=[], superuser_groups=["root"], teams=[])
    assert boss.is_staff and boss.is_superuser
    nobody = sso.roles_from_groups([], staff_groups=["ops"], superuser_groups=[], teams=["a"])
    assert nobody == sso.Roles(False, False, frozenset())


@pytest.mark.parametrize(
    ("claims", "username"),
    [
        ({"preferred_username": "carol", "email": "c@x.org", "sub": "1"}, "carol"),
        ({"preferred_username": "bad name!", "email": "c@x.org", "sub": "1"}, "c@x.org"),
        ({"sub": "abc"}, "oidc-ba7816bf8f01cfea"),
    ],
)
def test_usernames_from_claims(claims: dict[str, str], username: str) -> None:
    assert sso.username_for(claims) == username


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"aud": "someone-else"}, "(?i)audience"),
        ({"iss": "http://evil.example"}, "(?i)issuer"),
        ({"exp": int(time.time()) - 3600}, "expired"),
    ],
)
def test_id_tokens_for_another_client_issuer_or_time_are_refused(
    settings: Any, change: dict[str, Any], message: str
) -> None:
    settings.LLMGW_OIDC_ISSUER = "http://idp.example"
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_OP_JWKS_ENDPOINT = "unused"
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    claims = {
        "iss": "http://idp.example",
        "aud": CLIENT_ID,
        "iat": now,
        "exp": now + 60,
        "sub": "s",
    }
    backend = sso.Backend.__new__(sso.Backend)
    backend.OIDC_RP_SIGN_ALGO = "RS256"
    backend.OIDC_RP_CLIENT_ID = CLIENT_ID
    good = jwt.encode(claims, key, algorithm="RS256")
    assert backend.get_payload_data(good, key.public_key())["sub"] == "s"
    bad = jwt.encode({**claims, **change}, key, algorithm="RS256")
    with pytest.raises(SuspiciousOperation, match=message):
        backend.get_payload_data(bad, key.public_key())
    unsigned = jwt.encode(claims, "a-secret-shared-with-nobody-at-all-32+", algorithm="HS256")
    with pytest.raises(SuspiciousOperation, match="RS256"):
        backend.get_payload_data(unsigned, key.public_key())


# --------------------------------------------------------------------------- in a real browser


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(300)
def test_a_browser_signs_in_through_the_provider_to_the_dashboard_or_the_account_page(
    provider: str, tmp_path: Path
) -> None:
    Group.objects.create(name="research")
    web = start_web(tmp_path / "web", **sso_env(provider))
    base = f"http://127.0.0.1:{web.port}"
    try:
        browse(base, provider, tmp_path, "carol", "carol-pw", lands="/admin/")
        browse(base, provider, tmp_path, "dave", "dave-pw", lands="/account/")
        assert User.objects.get(username="carol").is_staff
        assert not User.objects.get(username="dave").is_staff
    finally:
        web.stop()


def browse(
    base: str, provider: str, tmp_path: Path, username: str, password: str, lands: str
) -> None:
    """One person, in a fresh browser: the sign-in page, the provider's form, and back."""
    browser = Browser(tmp_path / f"chromium-{username}")
    try:
        browser.goto(f"{base}/account/login/")
        browser.submit("#lg-sso")
        wait_until(lambda: provider in browser.url, what="the provider's sign-in form")
        browser.type("#username", username)
        browser.type("#password", password)
        browser.submit("#sign-in")
        wait_until(lambda: browser.url == f"{base}{lands}", what=f"{username} on {lands}")
        if lands == "/admin/":
            wait_until(
                lambda: browser.eval("!!document.getElementById('llmgw-dashboard')"),
                what="the dashboard",
            )
        else:
            assert username in browser.text()
            browser.goto(f"{base}/admin/")
            assert "/admin/login/" in browser.url  # not staff: no console
        browser.screenshot(tmp_path / f"sso-{username}.png")
    finally:
        browser.close()
