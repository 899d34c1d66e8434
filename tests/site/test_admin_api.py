"""The admin API (/api/admin/v1/): one test or more per route, its authentication (admin tokens,
staff sessions with CSRF), its errors (a code and the field at fault) and its pagination."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.test import Client

from control import node_certs, node_tokens
from control.models import Event, Node, Profile, Replica, ServedModel
from gateway.identity import allowances, keys
from gateway.models import ApiKey, SsoLinkName, TeamLimits, UserLimits
from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from tests.harness.factories import (
    PASSWORD,
    make_key,
    make_model,
    make_node,
    make_replica,
    make_usage,
    make_user,
)

pytestmark = pytest.mark.django_db

BASE = "/api/admin/v1"


class Api:
    """A program calling the API with one admin token, as an operator's script would."""

    def __init__(self, token: str) -> None:
        self.client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(self, method: str, path: str, body: Any = None, **params: Any) -> tuple[int, Any]:
        send = getattr(self.client, method.lower())
        if body is not None:
            response = send(f"{BASE}{path}", json.dumps(body), content_type="application/json")
        elif method in {"GET", "DELETE"}:
            response = send(f"{BASE}{path}", params)
        else:
            response = send(f"{BASE}{path}")
        data = json.loads(response.content) if response.content else None
        return response.status_code, data

    def get(self, path: str, **params: Any) -> Any:
        status, data = self.call("GET", path, **params)
        assert status == 200, data
        return data


@pytest.fixture
def api() -> Api:
    return Api(tokens.issue("tests", scope=AdminToken.Scope.WRITE).token)


@pytest.fixture
def reader() -> Api:
    return Api(tokens.issue("tests-read", scope=AdminToken.Scope.READ).token)


# --------------------------------------------------------------------------- authentication


def test_no_credentials_is_401_with_a_code() -> None:
    response = Client().get(f"{BASE}/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize(
    "header",
    ["Bearer llmgw-admin-" + "x" * 43, "Bearer nonsense", "Basic YWRtaW46YWRtaW4=", "Bearer "],
)
def test_wrong_tokens_are_refused(header: str) -> None:
    response = Client(HTTP_AUTHORIZATION=header).get(f"{BASE}/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


def test_a_revoked_or_expired_token_stops_working() -> None:
    issued = tokens.issue("ci")
    api = Api(issued.token)
    assert api.call("GET", "/models")[0] == 200
    assert tokens.revoke(issued.row.pk) is True
    assert tokens.revoke(issued.row.pk) is False
    assert api.call("GET", "/models")[0] == 401
    expired = tokens.issue("old")
    AdminToken.objects.filter(pk=expired.row.pk).update(expires_at="2000-01-01T00:00:00Z")
    assert Api(expired.token).call("GET", "/models")[0] == 401


def test_only_the_hash_of_a_token_is_stored() -> None:
    issued = tokens.issue("ci")
    row = AdminToken.objects.get()
    assert issued.token not in {row.prefix, row.token_hash}
    assert row.token_hash == tokens.hash_token(issued.token)
    assert issued.token.startswith(row.prefix) and len(row.prefix) < len(issued.token) // 2


def test_a_read_only_token_reads_but_cannot_write(reader: Api) -> None:
    node = make_node("gpu-1")
    assert reader.get("/nodes")["count"] == 1
    status, body = reader.call("POST", "/nodes/gpu-1/drain")
    assert status == 403 and body["error"]["code"] == "read_only"
    assert Node.objects.get(pk=node.pk).schedule == Node.Schedule.ACTIVE


def test_a_staff_session_reads_and_a_superuser_writes_only_with_csrf() -> None:
    make_node("gpu-1")
    staff = Client(enforce_csrf_checks=True)
    # Reads need the view permission the admin's pages need (tests/site/test_admin_permissions).
    staff.force_login(make_user("ops", staff=True, perms=["control.view_node"]))
    assert staff.get(f"{BASE}/nodes").status_code == 200
    assert staff.post(f"{BASE}/nodes/gpu-1/cordon").json()["error"]["code"] == "csrf_failed"

    root = Client(enforce_csrf_checks=True)
    root.force_login(make_user("root", superuser=True))
    root.get("/admin/")  # sets the CSRF cookie, as the admin's pages do
    token = root.cookies["csrftoken"].value
    assert root.post(f"{BASE}/nodes/gpu-1/cordon").status_code == 403
    response = root.post(f"{BASE}/nodes/gpu-1/cordon", HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 200 and response.json()["changed"] is True
    staff_token = staff.get("/admin/") and staff.cookies["csrftoken"].value
    denied = staff.post(f"{BASE}/nodes/gpu-1/undrain", HTTP_X_CSRFTOKEN=staff_token)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "read_only"
    assert Node.objects.get(name="gpu-1").schedule == Node.Schedule.CORDONED


def test_a_non_staff_session_is_refused() -> None:
    client = Client()
    client.force_login(make_user("alice"))
    assert client.get(f"{BASE}/nodes").status_code == 401


def test_create_admin_token_prints_the_token_once_and_it_works() -> None:
    out, err = io.StringIO(), io.StringIO()
    call_command("create_admin_token", "ci-catalog", "--scope", "write", stdout=out, stderr=err)
    token = out.getvalue().strip()
    row = AdminToken.objects.get()
    assert row.scope == "write" and row.name == "ci-catalog" and token not in err.getvalue()
    assert Api(token).call("POST", "/nodes/none/drain")[0] == 404  # authorised, no such node
    call_command("revoke_admin_token", row.prefix, stdout=io.StringIO())
    assert Api(token).call("GET", "/nodes")[0] == 401


def test_the_admin_issues_an_admin_token_once_and_revokes_it() -> None:
    client = Client()
    client.force_login(make_user("root", superuser=True))
    page = client.post(
        "/admin/admin_api/admintoken/add/", {"name": "deploy", "scope": "read"}
    ).content.decode()
    row = AdminToken.objects.get()
    token = page.split('id="llmgw-new-admin-token" class="lg-key">')[1].split("<")[0]
    assert tokens.check(token) is not None and row.created_by is not None
    client.post(
        "/admin/admin_api/admintoken/",
        {"action": "revoke", "_selected_action": [row.pk]},
    )
    assert tokens.check(token) is None
    staff = Client()
    staff.force_login(make_user("ops", staff=True))
    assert staff.get("/admin/admin_api/admintoken/").status_code == 403


def test_the_openapi_document_lists_every_route() -> None:
    client = Client()
    client.force_login(make_user("ops", staff=True))
    doc = Client().get(f"{BASE}/openapi.json")
    if doc.status_code != 200:  # the document is for staff and tokens alike
        doc = client.get(f"{BASE}/openapi.json")
    paths = doc.json()["paths"]
    for path in [
        "/api/admin/v1/models",
        "/api/admin/v1/models/{name}/scale",
        "/api/admin/v1/nodes/{name}/drain",
        "/api/admin/v1/replicas/{replica_id}/restart",
        "/api/admin/v1/keys",
        "/api/admin/v1/usage",
        "/api/admin/v1/catalog",
        "/api/admin/v1/lease",
        "/api/admin/v1/users/{username}/limits",
        "/api/admin/v1/teams/{name}/limits",
        "/api/admin/v1/nodes/{name}/certificate",
    ]:
        assert path in paths, path


# --------------------------------------------------------------------------- the catalog


def test_profiles_create_read_update_delete(api: Api) -> None:
    status, body = api.call("POST", "/profiles", {"name": "vllm-tp2", "engine": "vllm"})
    assert status == 201 and body["engine"] == "vllm" and body["gpus_per_shard"] == 1
    status, body = api.call("POST", "/profiles", {"name": "vllm-tp2"})
    assert status == 409 and body["error"] == {
        "code": "exists",
        "message": "profile 'vllm-tp2' exists",
        "field": "name",
    }
    status, body = api.call("PATCH", "/profiles/vllm-tp2", {"gpus_per_shard": 2})
    assert status == 200 and body["gpus_per_shard"] == 2
    assert api.get("/profiles/vllm-tp2")["gpus_per_shard"] == 2
    assert api.get("/profiles")["items"][0]["name"] == "vllm-tp2"
    assert api.call("DELETE", "/profiles/vllm-tp2")[0] == 204
    assert not Profile.objects.exists()


def test_a_profile_in_use_is_not_deleted(api: Api) -> None:
    make_model("llama3")
    status, body = api.call("DELETE", "/profiles/llama3-sim")
    assert status == 409 and body["error"]["code"] == "in_use"
    assert Profile.objects.filter(name="llama3-sim").exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "p", "gpus_per_shard": 0}, "gpus_per_shard"),
        ({"name": "p", "colour": "red"}, "colour"),
        ({"name": "p", "engine": "tensorrt"}, "engine"),
        ({"name": "p", "env": {"BAD NAME": "x"}}, "env"),
        ({"name": "bad name"}, "name"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_field(api: Api, body: Any, field: str) -> None:
    status, answer = api.call("POST", "/profiles", body)
    assert status == 422, answer
    assert answer["error"]["code"] == "invalid" and answer["error"]["field"] == field
    assert not Profile.objects.exists()


def test_models_create_read_update_delete(api: Api) -> None:
    api.call("POST", "/profiles", {"name": "sim"})
    status, body = api.call(
        "POST", "/models", {"name": "llama3", "source": "org/llama3", "default_profile": "sim"}
    )
    assert status == 201, body
    assert body["profiles"] == ["sim"] and body["min_replicas"] == 0 and body["enabled"]
    status, body = api.call("PATCH", "/models/llama3", {"aliases": ["l3"], "idle_timeout_s": 60})
    assert status == 200 and body["aliases"] == ["l3"] and body["idle_timeout_s"] == 60
    assert api.get("/models/llama3")["default_profile"] == "sim"
    assert api.get("/models/llama3")["context_length"] is None, "as the engine reports it"
    status, body = api.call("PATCH", "/models/llama3", {"context_length": 8192})
    assert status == 200 and body["context_length"] == 8192
    assert ServedModel.objects.get().context_length == 8192
    assert api.get("/models")["count"] == 1
    assert api.call("DELETE", "/models/llama3")[0] == 204
    assert not ServedModel.objects.exists()
    (event,) = Event.objects.filter(subject="model/llama3")
    assert event.data == {"actor": "token:tests", "deleted": True}
    assert api.call("GET", "/models/llama3")[0] == 404


def test_deleting_a_model_tells_the_nodes_that_ran_it(api: Api) -> None:
    node = make_node("gpu-1")
    make_replica(make_model("llama3"), [(node, [0])])
    assert api.call("DELETE", "/models/llama3")[0] == 204
    assert not Replica.objects.exists()
    assert Node.objects.get(pk=node.pk).desired_revision >= 1


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"name": "m", "source": "s", "default_profile": "nope"}, 422, "default_profile"),
        ({"name": "m", "source": "s"}, 422, "default_profile"),
        ({"name": "m", "source": "s", "default_profile": "sim", "max_replicas": 0}, 422,
         "max_replicas"),
        ({"name": "m", "source": "s", "default_profile": "sim", "min_replicas": 3,
          "max_replicas": 1}, 422, "min_replicas"),
        ({"name": "m", "source": "s", "default_profile": "sim", "profiles": ["sim", "x"]}, 422,
         "profiles[1]"),
        ({"name": "m", "source": "s", "default_profile": "sim", "context_length": 0}, 422,
         "context_length"),
    ],
)  # fmt: skip
def test_a_bad_model_is_refused_naming_the_field(
    api: Api, body: Any, status: int, field: str
) -> None:
    api.call("POST", "/profiles", {"name": "sim"})
    got, answer = api.call("POST", "/models", body)
    assert (got, answer["error"]["field"]) == (status, field), answer
    assert not ServedModel.objects.exists()


def test_scale_and_pin_record_who_did_it(api: Api) -> None:
    make_model("llama3")
    status, body = api.call("POST", "/models/llama3/scale", {"min_replicas": 1, "max_replicas": 3})
    assert status == 200 and (body["min_replicas"], body["max_replicas"]) == (1, 3)
    status, body = api.call("POST", "/models/llama3/scale", {"min_replicas": 4, "max_replicas": 3})
    assert status == 422 and body["error"]["field"] == "min_replicas"
    status, body = api.call("POST", "/models/llama3/pin", {"pinned": True})
    assert status == 200 and body["pinned"] is True
    kinds = [e.data for e in Event.objects.filter(subject="model/llama3").order_by("id")]
    assert kinds == [
        {"actor": "token:tests", "min_replicas": 1, "max_replicas": 3},
        {"actor": "token:tests", "pinned": True},
    ]
    assert api.call("POST", "/models/nope/pin", {"pinned": True})[0] == 404


def test_an_entry_update_that_scales_badly_changes_nothing(api: Api) -> None:
    """The scale part of an entry update is checked like ``…/scale``; a refusal there leaves
    the rest of the update undone too."""
    make_model("llama3", max_replicas=2)
    status, body = api.call(
        "PATCH", "/models/llama3", {"aliases": ["l3"], "min_replicas": 3, "pinned": True}
    )
    assert status == 422 and body["error"]["field"] == "min_replicas", body
    model = ServedModel.objects.get(name="llama3")
    assert (model.aliases, model.min_replicas, model.pinned) == ([], 0, False)
    assert not Event.objects.filter(subject="model/llama3").exists()


# --------------------------------------------------------------------------- the fleet


def test_nodes_list_filter_and_show_gpus(api: Api) -> None:
    make_node("gpu-1", gpus=[(81920, 0)] * 2)
    make_node("gpu-2", schedule=Node.Schedule.CORDONED)
    listed = api.get("/nodes")
    assert listed["count"] == 2 and len(listed["items"][0]["gpus"]) == 2
    assert [n["name"] for n in api.get("/nodes", schedule="cordoned")["items"]] == ["gpu-2"]
    assert api.get("/nodes/gpu-2")["state"] == "cordoned"
    status, body = api.call("GET", "/nodes", schedule="sideways")
    assert status == 422 and body["error"]["field"] == "schedule"


@pytest.mark.parametrize(
    ("verb", "schedule"),
    [("cordon", "cordoned"), ("drain", "draining"), ("undrain", "active")],
)
def test_node_schedule_routes(api: Api, verb: str, schedule: str) -> None:
    start = Node.Schedule.ACTIVE if verb != "undrain" else Node.Schedule.DRAINING
    make_node("gpu-1", schedule=start)
    status, body = api.call("POST", f"/nodes/gpu-1/{verb}")
    assert status == 200 and body["changed"] is True and body["node"]["schedule"] == schedule
    assert api.call("POST", f"/nodes/gpu-1/{verb}")[1]["changed"] is False
    assert api.call("POST", f"/nodes/nope/{verb}")[0] == 404


def test_node_tokens_issue_once_and_revoke(api: Api) -> None:
    status, body = api.call("POST", "/nodes/gpu-9/token")
    assert status == 201 and body["token"].startswith(body["prefix"])
    node = Node.objects.get(name="gpu-9")
    assert node.token_prefix == body["prefix"] and body["token"] not in node.token_hash
    assert api.call("DELETE", "/nodes/gpu-9/token")[1] == {"changed": True}
    assert api.call("DELETE", "/nodes/gpu-9/token")[1] == {"changed": False}
    status, body = api.call("POST", "/nodes/bad%20name/token")
    assert status == 422 and body["error"]["field"] == "name"


def test_replicas_list_filter_and_restart(api: Api) -> None:
    a, b = make_node("gpu-a"), make_node("gpu-b")
    replica = make_replica(make_model("llama3"), [(a, [0])])
    make_replica(make_model("qwen"), [(b, [0])], desired=Replica.Desired.STOPPED)
    assert api.get("/replicas")["count"] == 2
    (only,) = api.get("/replicas", node="gpu-a")["items"]
    assert only["model"] == "llama3" and only["shards"][0]["node"] == "gpu-a"
    assert api.get("/replicas", desired="stopped")["items"][0]["model"] == "qwen"
    assert api.get(f"/replicas/{replica.pk}")["generation"] == 1
    status, body = api.call("POST", f"/replicas/{replica.pk}/restart")
    assert status == 200 and body["changed"] and body["replica"]["generation"] == 2
    assert api.call("POST", "/replicas/999/restart")[0] == 404


def test_events_newest_first_with_filters(api: Api) -> None:
    node = make_node("gpu-1")
    make_model("llama3")
    from control import operations

    operations.cordon_node(node.pk, actor="t")
    operations.pin_model(ServedModel.objects.get().pk, pinned=True, actor="t")
    events = api.get("/events")["items"]
    assert [e["subject"] for e in events] == ["model/llama3", "node/gpu-1"]
    assert api.get("/events", subject="node/")["count"] == 1
    assert api.get("/events", subject="node/gpu-1", kind="operator")["count"] == 1
    assert api.get("/events", kind="placement")["count"] == 0


def test_the_lease_route_says_who_leads(api: Api, election_on: Any) -> None:
    body = api.get("/lease")
    assert body["name"] == "reconciler" and body["held"] is False
    from control import leases

    leases.claim()
    body = api.get("/lease")
    assert body["held"] is True and body["owner"] == leases.owner_id() and body["epoch"] >= 1


# --------------------------------------------------------------------------- people and keys


def test_users_create_list_update(api: Api) -> None:
    Group.objects.create(name="research")
    status, body = api.call("POST", "/users", {"username": "bob", "teams": ["research"]})
    assert status == 201 and body["teams"] == ["research"] and not body["is_staff"]
    assert not User.objects.get(username="bob").has_usable_password()
    assert api.call("POST", "/users", {"username": "bob"})[1]["error"]["code"] == "exists"
    status, body = api.call("POST", "/users", {"username": "eve", "teams": ["nope"]})
    assert status == 422 and body["error"]["field"] == "teams"
    status, body = api.call("PATCH", "/users/bob", {"is_staff": True, "teams": []})
    assert status == 200 and body["is_staff"] and body["teams"] == []
    assert api.get("/users", staff=True)["items"][0]["username"] == "bob"
    assert api.get("/users/bob")["is_active"] is True
    assert api.call("PATCH", "/users/nobody", {"is_active": False})[0] == 404
    status, body = api.call("POST", "/users", {"username": "x", "is_superuser": True})
    assert status == 422 and body["error"]["field"] == "is_superuser"


def test_a_user_provisioned_with_a_provider_name_for_single_sign_on(api: Api) -> None:
    status, body = api.call("POST", "/users", {"username": "dsmith", "sso_username": "dave"})
    assert status == 201 and body["username"] == "dsmith"
    assert SsoLinkName.objects.get(provider_username="dave").user.username == "dsmith"
    status, body = api.call("POST", "/users", {"username": "other", "sso_username": "dave"})
    assert status == 409 and body["error"]["field"] == "sso_username"
    assert not User.objects.filter(username="other").exists()


def test_teams_create_members_delete(api: Api) -> None:
    make_user("alice")
    make_user("bob")
    status, body = api.call("POST", "/teams", {"name": "research", "members": ["alice"]})
    assert status == 201 and body["members"] == ["alice"]
    status, body = api.call("PUT", "/teams/research/members", {"members": ["bob", "alice"]})
    assert status == 200 and body["members"] == ["alice", "bob"]
    assert api.get("/teams")["items"][0]["name"] == "research"
    assert api.get("/users", team="research")["count"] == 2
    assert api.get("/teams/research")["members"] == ["alice", "bob"]
    status, body = api.call("PUT", "/teams/research/members", {"members": ["carol"]})
    assert status == 422 and body["error"]["field"] == "members"
    assert api.call("DELETE", "/teams/research")[0] == 204
    assert api.call("DELETE", "/teams/research")[0] == 404


def test_api_keys_issue_once_list_and_revoke(api: Api) -> None:
    make_user("alice")
    status, body = api.call(
        "POST", "/keys", {"user": "alice", "name": "ci", "models": ["llama3"], "rpm_limit": 60}
    )
    assert status == 201, body
    key, row = body["key"], body["api_key"]
    stored = ApiKey.objects.get()
    assert key.startswith(stored.prefix) and key not in stored.key_hash
    assert row["allowed_models"] == ["llama3"] and row["rpm_limit"] == 60 and row["user"] == "alice"
    assert "key" not in api.get(f"/keys/{stored.pk}")
    assert api.get("/keys", user="alice")["count"] == 1
    assert api.call("POST", f"/keys/{stored.pk}/revoke")[1] == {"changed": True}
    assert api.call("POST", f"/keys/{stored.pk}/revoke")[1] == {"changed": False}
    assert api.get("/keys", revoked=True)["count"] == 1
    status, body = api.call("POST", "/keys", {"user": "nobody"})
    assert status == 422 and body["error"]["field"] == "user"


def effective(key: ApiKey) -> Any:
    """What the request path makes of the key: its limits narrowed by its owner's and teams'."""
    return keys._load(key.key_hash)


def test_user_limits_read_set_and_clear_bind_the_users_keys(api: Api) -> None:
    _, key = make_key("alice", name="ci")
    assert api.get("/users/alice/limits") == {
        "allowed_models": [],
        "rpm_limit": None,
        "tpm_limit": None,
        "token_budget": None,
        "budget_period": "month",
        "spent": 0,
        "period_start": api.get("/users/alice/limits")["period_start"],
        "self_service": True,
    }
    status, body = api.call(
        "PATCH",
        "/users/alice/limits",
        {
            "allowed_models": ["qwen", "llama3", "qwen"],
            "rpm_limit": 30,
            "tpm_limit": 1000,
            "token_budget": 5000,
            "budget_period": "day",
            "self_service": False,
        },
    )
    assert status == 200, body
    assert body["allowed_models"] == ["llama3", "qwen"] and body["budget_period"] == "day"
    row = UserLimits.objects.get(user__username="alice")
    assert (row.rpm_limit, row.tpm_limit, row.token_budget, row.self_service) == (
        30,
        1000,
        5000,
        False,
    )
    info = effective(key)
    assert info.allowed_models == frozenset({"llama3", "qwen"})
    assert [(s.name, s.rpm_limit, s.token_budget) for s in info.scopes] == [
        (f"user:{key.user_id}", 30, 5000)
    ]

    event = Event.objects.get(subject="user/alice")
    assert event.kind == Event.Kind.OPERATOR and event.message.startswith("limits set by token:")
    assert event.data["changes"]["rpm_limit"] == {"from": None, "to": 30}
    assert event.data["changes"]["self_service"] == {"from": True, "to": False}

    # A partial change keeps the rest; null lifts one limit.
    status, body = api.call("PATCH", "/users/alice/limits", {"rpm_limit": None})
    assert status == 200 and body["rpm_limit"] is None and body["token_budget"] == 5000
    assert not allowances.self_service_allowed(key.user_id)
    assert Event.objects.filter(subject="user/alice").latest("id").message == (
        "limits changed by token:tests: rpm_limit 30 → none"
    )
    # The same values again change nothing, and say nothing.
    assert api.call("PATCH", "/users/alice/limits", {"rpm_limit": None})[0] == 200
    assert Event.objects.filter(subject="user/alice").count() == 2

    # What alice used today counts against her budget.
    make_usage(model="llama3", api_key=key, prompt_tokens=40, completion_tokens=2)
    assert api.get("/users/alice/limits")["spent"] == 42

    assert api.call("DELETE", "/users/alice/limits")[1] == {"changed": True}
    assert api.call("DELETE", "/users/alice/limits")[1] == {"changed": False}
    assert not UserLimits.objects.exists() and allowances.self_service_allowed(key.user_id)
    assert Event.objects.filter(subject="user/alice").latest("id").message == (
        "limits removed by token:tests"
    )
    assert not effective(key).scopes


def test_team_limits_read_set_and_clear_bind_the_members_keys(api: Api) -> None:
    _, key = make_key("alice")
    team = Group.objects.create(name="research")
    team.user_set.add(key.user_id)
    assert api.get("/teams/research/limits")["token_budget"] is None
    status, body = api.call(
        "PATCH", "/teams/research/limits", {"token_budget": 100, "allowed_models": ["llama3"]}
    )
    assert status == 200 and body["token_budget"] == 100 and body["allowed_models"] == ["llama3"]
    assert TeamLimits.objects.get(team__name="research").token_budget == 100
    info = effective(key)
    assert info.allowed_models == frozenset({"llama3"})
    assert [(s.name, s.token_budget) for s in info.scopes] == [(f"team:{team.pk}", 100)]
    assert api.call("DELETE", "/teams/research/limits")[1] == {"changed": True}
    assert not TeamLimits.objects.exists() and not effective(key).scopes


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/users/alice/limits", {"rpm_limit": -1}, "rpm_limit"),
        ("/users/alice/limits", {"token_budget": "lots"}, "token_budget"),
        ("/users/alice/limits", {"budget_period": "year"}, "budget_period"),
        ("/users/alice/limits", {"budget_period": None}, "budget_period"),
        ("/users/alice/limits", {"allowed_models": ["ok", ""]}, "allowed_models"),
        ("/users/alice/limits", {"allowed_models": None}, "allowed_models"),
        ("/users/alice/limits", {"self_service": None}, "self_service"),
        ("/users/alice/limits", {"colour": "red"}, "colour"),
        ("/teams/research/limits", {"self_service": False}, "self_service"),
        ("/teams/research/limits", {"tpm_limit": 2**40}, "tpm_limit"),
    ],
)
def test_bad_limits_are_refused_naming_the_field_and_change_nothing(
    api: Api, path: str, body: Any, field: str
) -> None:
    make_user("alice")
    Group.objects.create(name="research")
    status, answer = api.call("PATCH", path, body)
    assert status == 422, answer
    assert answer["error"]["field"] == field
    assert not UserLimits.objects.exists() and not TeamLimits.objects.exists()


def test_limits_of_someone_missing_are_404(api: Api) -> None:
    for method, body in (("GET", None), ("PATCH", {"rpm_limit": 1}), ("DELETE", None)):
        status, answer = api.call(method, "/users/nobody/limits", body)
        assert status == 404 and answer["error"]["field"] == "username"
        status, answer = api.call(method, "/teams/nobody/limits", body)
        assert status == 404 and answer["error"]["field"] == "name"


def test_a_read_only_token_reads_limits_but_cannot_set_them(reader: Api) -> None:
    make_user("alice")
    assert reader.get("/users/alice/limits")["rpm_limit"] is None
    status, body = reader.call("PATCH", "/users/alice/limits", {"rpm_limit": 1})
    assert status == 403 and body["error"]["code"] == "read_only"
    assert not UserLimits.objects.exists()


@pytest.fixture
def ca_dir(tmp_path: Path, settings: Any) -> Path:
    settings.LLMGW_CA_DIR = tmp_path / "ca"
    call_command("init_ca", stdout=io.StringIO())
    return Path(settings.LLMGW_CA_DIR)


def test_node_certificates_issue_once_and_revoke(api: Api, ca_dir: Path) -> None:
    status, body = api.call("POST", "/nodes/gpu-9/certificate")
    assert status == 201, body
    cert = x509.load_pem_x509_certificate(body["certificate"].encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-9"
    ca = x509.load_pem_x509_certificate(body["ca_certificate"].encode())
    assert cert.issuer == ca.subject and ca == x509.load_pem_x509_certificate(
        (ca_dir / "ca.pem").read_bytes()
    )
    key = serialization.load_pem_private_key(body["key"].encode(), password=None)
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)
    node = Node.objects.get(name="gpu-9")
    assert node.cert_serial == body["serial"] == format(cert.serial_number, "x")
    assert api.get("/nodes/gpu-9")["cert_serial"] == body["serial"]
    # The key is handed over, not kept: no copy on the control plane's disk or in the store.
    assert not list(ca_dir.rglob("gpu-9*"))
    assert node_certs.authenticate_certificate(body["certificate"].encode(), "gpu-9").name == (
        "gpu-9"
    )

    # A second certificate replaces the first.
    status, second = api.call("POST", "/nodes/gpu-9/certificate")
    assert status == 201 and second["serial"] != body["serial"]
    with pytest.raises(node_tokens.TokenRejected):
        node_certs.authenticate_certificate(body["certificate"].encode(), "gpu-9")

    assert api.call("DELETE", "/nodes/gpu-9/certificate")[1] == {"changed": True}
    assert api.call("DELETE", "/nodes/gpu-9/certificate")[1] == {"changed": False}
    with pytest.raises(node_tokens.TokenRejected):
        node_certs.authenticate_certificate(second["certificate"].encode(), "gpu-9")
    messages = list(
        Event.objects.filter(subject="node/gpu-9").order_by("id").values_list("message", flat=True)
    )
    assert [m.split(" (")[0] for m in messages] == [
        "node certificate issued",
        "node certificate issued",
        "node certificate revoked",
    ]


def test_node_certificate_errors_name_what_is_wrong(
    api: Api, reader: Api, tmp_path: Path, settings: Any
) -> None:
    settings.LLMGW_CA_DIR = tmp_path / "none"
    status, body = api.call("POST", "/nodes/gpu-9/certificate")
    assert (
        status == 409 and body["error"]["code"] == "no_ca" and "init_ca" in body["error"]["message"]
    )
    assert not Node.objects.exists()
    status, body = api.call("POST", "/nodes/bad%20name/certificate")
    assert status == 422 and body["error"]["field"] == "name"
    status, body = api.call("DELETE", "/nodes/gpu-404/certificate")
    assert status == 404
    status, body = reader.call("POST", "/nodes/gpu-9/certificate")
    assert status == 403 and body["error"]["code"] == "read_only"


# --------------------------------------------------------------------------- usage


def test_usage_by_key_user_team_model_and_period(api: Api) -> None:
    _, alice_key = make_key("alice")
    _, bob_key = make_key("bob")
    Group.objects.create(name="research").user_set.add(User.objects.get(username="alice"))
    make_usage(
        model="llama3", api_key=alice_key, prompt_tokens=10, completion_tokens=5, cached_tokens=8
    )
    make_usage(model="llama3", api_key=alice_key, prompt_tokens=1, completion_tokens=1)
    make_usage(model="qwen", api_key=bob_key, prompt_tokens=100, completion_tokens=0, status=500)

    by_model = {r["group"]: r for r in api.get("/usage", by="model")["items"]}
    assert by_model["llama3"]["total_tokens"] == 17 and by_model["llama3"]["requests"] == 2
    assert by_model["llama3"]["cached_tokens"] == 8
    assert by_model["qwen"]["errors"] == 1
    assert [r["group"] for r in api.get("/usage", by="user")["items"]] == ["bob", "alice"]
    teams = {r["group"]: r["requests"] for r in api.get("/usage", by="team")["items"]}
    assert teams == {"research": 2, "(no team)": 1}
    assert api.get("/usage", team="research", by="model")["count"] == 1
    assert api.get("/usage", key=alice_key.prefix, by="key")["items"][0]["requests"] == 2
    assert api.get("/usage", model="qwen")["items"][0]["prompt_tokens"] == 100
    assert api.get("/usage", since="2999-01-01T00:00:00Z")["count"] == 0
    status, body = api.call("GET", "/usage", by="colour")
    assert status == 422 and body["error"]["field"] == "by"


# --------------------------------------------------------------------------- pagination


def test_every_list_is_paginated(api: Api) -> None:
    for i in range(5):
        make_node(f"gpu-{i}")
    page = api.get("/nodes", limit=2, offset=2)
    assert page["count"] == 5 and [n["name"] for n in page["items"]] == ["gpu-2", "gpu-3"]
    status, body = api.call("GET", "/nodes", limit=0)
    assert status == 422 and body["error"]["field"] == "limit"
    for path in ["/profiles", "/models", "/nodes", "/replicas", "/events", "/users", "/teams",
                 "/keys", "/usage"]:  # fmt: skip
        body = api.get(path, limit=1)
        assert set(body) == {"items", "count"}, path


def test_a_malformed_json_body_is_a_json_error(api: Api) -> None:
    response = api.client.post(f"{BASE}/profiles", "{nope", content_type="application/json")
    assert response.status_code in {400, 422}
    assert response.json()["error"]["code"] in {"bad_request", "invalid"}


def test_a_password_is_never_accepted_by_the_api(api: Api) -> None:
    status, body = api.call("POST", "/users", {"username": "x", "password": PASSWORD})
    assert status == 422 and body["error"]["field"] == "password"


@pytest.mark.parametrize(
    "path",
    [
        "/replicas/99999999999999999999999",
        "/keys/99999999999999999999999",
        "/nodes?offset=99999999999999999999999",
        "/events?since=not-a-date",
    ],
)
def test_numbers_past_the_stores_integers_are_refused_not_crashed(api: Api, path: str) -> None:
    status, body = api.call("GET", path)
    assert status in {404, 422}, body
    assert body["error"]["code"] in {"not_found", "invalid"}


@pytest.mark.parametrize(
    "path", ["/replicas/99999999999999999999999/restart", "/keys/99999999999999999999999/revoke"]
)
def test_writes_to_huge_ids_are_refused_not_crashed(api: Api, path: str) -> None:
    status, body = api.call("POST", path)
    assert status in {404, 422}, body


def test_text_with_nul_characters_is_refused_naming_the_field(api: Api) -> None:
    status, body = api.call("POST", "/teams", {"name": "re\x00search"})
    assert status == 422 and body["error"]["field"] == "name"
    status, body = api.call("POST", "/profiles", {"name": "p", "env": {"A": "x\x00"}})
    assert status == 422 and body["error"]["field"] == "env"
    assert not Group.objects.exists() and not Profile.objects.exists()


def test_values_the_store_cannot_hold_are_a_422_not_a_500(api: Api) -> None:
    status, body = api.call(
        "GET", "/events", subject="node/\x00", since="0251-02-22T14:33:11-22:26"
    )
    assert status in {200, 422}, body  # SQLite holds both; PostgreSQL refuses them
    assert api.call("GET", "/events")[0] == 200  # and the next request is served
