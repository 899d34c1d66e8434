"""Who reads what: the admin API's reads need the same Django view permissions as the admin's
pages, and secrets in profile environments are shown masked to everyone but superusers (and
read-write admin tokens, which may do what a superuser may), everywhere: the admin API, the
admin's profile pages, catalog exports, the dashboard."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.test import Client

from control.models import Profile
from llmgw_site import catalog
from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from tests.harness.factories import (
    make_key,
    make_model,
    make_node,
    make_profile,
    make_replica,
    make_user,
)

pytestmark = pytest.mark.django_db

BASE = "/api/admin/v1"
SECRET = "hf_s3cretS3cretS3cretS3cretS3cret1"
ENV = {"HF_TOKEN": SECRET, "HF_HOME": "/data", "WANDB_API_KEY": "0123456789abcdef"}

# Every read route of the API and the permissions it needs, as the admin's pages need them.
READS = {
    "/profiles": ["control.view_profile"],
    "/profiles/{name}": ["control.view_profile"],
    "/models": ["control.view_servedmodel"],
    "/models/{name}": ["control.view_servedmodel"],
    "/catalog": ["control.view_profile", "control.view_servedmodel", "gateway.view_endpoint"],
    "/nodes": ["control.view_node"],
    "/nodes/{name}": ["control.view_node"],
    "/replicas": ["control.view_replica"],
    "/replicas/{replica_id}": ["control.view_replica"],
    "/lease": ["control.view_lease"],
    "/events": ["control.view_event"],
    "/users": ["auth.view_user"],
    "/users/{username}": ["auth.view_user"],
    "/users/{username}/limits": ["gateway.view_userlimits"],
    "/teams": ["auth.view_group"],
    "/teams/{name}": ["auth.view_group"],
    "/teams/{name}/limits": ["gateway.view_teamlimits"],
    "/keys": ["gateway.view_apikey"],
    "/keys/{key_id}": ["gateway.view_apikey"],
    "/usage": ["gateway.view_usagerecord"],
}


@pytest.fixture
def rows() -> dict[str, str]:
    """One of everything, and what each route's path parameters are."""
    from django.contrib.auth.models import Group

    profile = make_profile("p", env=ENV)
    model = make_model("m", profile=profile)
    node = make_node("n")
    replica = make_replica(model, [(node, [0])])
    _, key = make_key("u")
    Group.objects.create(name="t")
    return {
        "/profiles": "p",
        "/models": "m",
        "/nodes": "n",
        "/replicas": str(replica.pk),
        "/users": "u",
        "/teams": "t",
        "/keys": str(key.pk),
    }


def url(route: str, rows: dict[str, str]) -> str:
    head = "/" + route.split("/")[1]
    parts = [rows[head] if p.startswith("{") else p for p in route.split("/")]
    return BASE + "/".join(parts)


def session(*perms: str, superuser: bool = False, name: str = "ops") -> Client:
    client = Client()
    user = make_user(name, superuser=superuser, staff=True, perms=perms)
    client.force_login(user)
    return client


def token(scope: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {tokens.issue(scope, scope=scope).token}")


def test_the_table_names_every_read_route() -> None:
    doc = session(superuser=True, name="root").get(f"{BASE}/openapi.json").json()
    gets = {p.removeprefix(BASE) for p, ops in doc["paths"].items() if "get" in ops}
    assert gets == set(READS)


def test_staff_without_permissions_get_403_on_every_read_route(rows: dict[str, str]) -> None:
    client = session()
    answers = {route: client.get(url(route, rows)) for route in READS}
    assert {route: r.status_code for route, r in answers.items()} == dict.fromkeys(READS, 403)
    assert all(r.json()["error"]["code"] == "forbidden" for r in answers.values())
    assert all(SECRET not in r.content.decode() for r in answers.values())


@pytest.mark.parametrize("route", sorted(READS))
def test_staff_with_the_view_permission_read_that_route_and_no_other(
    route: str, rows: dict[str, str]
) -> None:
    needed = READS[route]
    assert session(*needed).get(url(route, rows)).status_code == 200
    for missing in needed:
        short = [p for p in needed if p != missing]
        client = session(*short, name=f"ops-{missing}")
        assert client.get(url(route, rows)).status_code == 403, missing


def test_the_change_permission_implies_the_view_permission_as_in_the_admin(
    rows: dict[str, str],
) -> None:
    client = session("control.change_node")
    assert client.get(url("/nodes", rows)).status_code == 200
    assert client.get("/admin/control/node/").status_code == 200
    assert client.get(url("/replicas", rows)).status_code == 403


def env_of(client: Client, rows: dict[str, str]) -> list[dict[str, str]]:
    """The profile's environment as each route that shows it shows it."""
    one = client.get(url("/profiles/{name}", rows)).json()["env"]
    listed = client.get(url("/profiles", rows)).json()["items"][0]["env"]
    exported = client.get(url("/catalog", rows)).json()["profiles"][0]["env"]
    return [one, listed, exported]


def test_staff_with_view_permission_read_profiles_with_their_secrets_masked(
    rows: dict[str, str],
) -> None:
    client = session(*READS["/catalog"])
    for env in env_of(client, rows):
        assert env["HF_HOME"] == "/data"  # not a secret: shown
        assert env["HF_TOKEN"] != SECRET and env["WANDB_API_KEY"] != "0123456789abcdef"
        assert env["HF_TOKEN"] == env["WANDB_API_KEY"] == "********"


def test_a_superuser_sees_the_real_values(rows: dict[str, str]) -> None:
    for env in env_of(session(superuser=True, name="root"), rows):
        assert env == ENV


def test_admin_tokens_read_every_route_and_only_read_write_tokens_see_secrets(
    rows: dict[str, str],
) -> None:
    reader, writer = token(AdminToken.Scope.READ), token(AdminToken.Scope.WRITE)
    for route in READS:
        assert reader.get(url(route, rows)).status_code == 200, route
    for env in env_of(reader, rows):
        assert env["HF_TOKEN"] == "********" and env["HF_HOME"] == "/data"
    for env in env_of(writer, rows):
        assert env == ENV


def test_the_admins_profile_page_masks_secrets_for_everyone_but_superusers() -> None:
    profile = make_profile("p", env=ENV)
    page = f"/admin/control/profile/{profile.pk}/change/"
    viewer = session("control.view_profile").get(page).content.decode()
    assert SECRET not in viewer and "HF_HOME" in viewer and "********" in viewer
    editor = session("control.view_profile", "control.change_profile", name="ed")
    text = editor.get(page).content.decode()
    assert SECRET not in text and 'name="env"' not in text  # shown masked, not editable
    # Saving the rest of the profile keeps its environment as it was.
    form = {
        "name": "p",
        "engine": "sim",
        "args": "[]",
        "gpus_per_shard": 1,
        "shards_per_replica": 1,
        "gpu_memory_mib": 0,
        "gpu_selector": "{}",
        "placement_strategy": "binpack",
        "health_path": "/health",
        "startup_timeout_s": 120,
        "env": json.dumps({"HF_ENDPOINT": "https://evil.example"}),
    }
    assert editor.post(page, form).status_code == 302
    profile.refresh_from_db()
    assert profile.env == ENV and profile.startup_timeout_s == 120
    root = session(superuser=True, name="root").get(page).content.decode()
    assert SECRET in root and 'name="env"' in root


def test_an_export_masks_secrets_unless_asked_for_them_and_a_masked_one_imports_back() -> None:
    make_profile("p", env=ENV)
    out = io.StringIO()
    call_command("export_catalog", stdout=out)
    masked = yaml.safe_load(out.getvalue())
    assert SECRET not in out.getvalue()
    assert masked["profiles"][0]["env"]["HF_TOKEN"] == "********"
    full = io.StringIO()
    call_command("export_catalog", "--with-secrets", stdout=full)
    assert yaml.safe_load(full.getvalue())["profiles"][0]["env"] == ENV
    # The masked document, applied back, keeps the stored secrets.
    result = catalog.import_data(masked)
    assert result.unchanged == ["profile p"]
    assert Profile.objects.get(name="p").env == ENV
    changed: dict[str, Any] = json.loads(json.dumps(masked))
    changed["profiles"][0]["env"]["HF_HOME"] = "/scratch"
    catalog.import_data(changed)
    assert Profile.objects.get(name="p").env == {**ENV, "HF_HOME": "/scratch"}


def test_a_masked_value_for_a_secret_the_profile_does_not_have_is_refused() -> None:
    document = {"profiles": [{"name": "new", "engine": "sim", "env": {"HF_TOKEN": "********"}}]}
    with pytest.raises(catalog.CatalogError, match="masked") as refused:
        catalog.import_data(document)
    assert refused.value.field == "profiles[0].env.HF_TOKEN"
    assert not Profile.objects.filter(name="new").exists()


def test_the_dashboard_shows_no_secret() -> None:
    make_model("m", profile=make_profile("p", env=ENV))
    client = session()
    text = client.get("/admin/dashboard.json").content.decode()
    assert SECRET not in text and "HF_TOKEN" not in text
