"""Three edges, one behaviour: each operator change made through the admin, through its
``manage.py`` command and through the admin API leaves the same rows and the same Events.

Each edge runs on the same starting rows inside a savepoint that is rolled back after the
outcome is read, so the three outcomes are compared on equal terms. Who did it differs by edge
(``admin:root``, ``cli:…``, ``token:ops``) and is normalised; so are the parts a change mints
afresh each time (a token's prefix, a certificate's serial), which are checked to be there.

A catalog entry (a profile or a model) is created or changed through the admin's add and change
forms, ``manage.py import_catalog`` with a file, and the API's routes (which call the same
import); the whole catalog document (``export_catalog``'s) must come out the same.

Users and teams are made and changed on Django's own user and group pages (whose saves and
deletes go through ``gateway.identity.people``), by ``create_user``, ``set_user``, ``create_team``,
``set_team_members`` and ``delete_team``, and by the API's people routes; the compared outcome
includes every user's fields, teams and permissions and every team's members.

Issuing a node certificate has two edges, the command and the API: the admin does not offer it,
because it would hand a private key to a browser page.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.contrib.auth.models import Group, Permission, User
from django.core.management import call_command
from django.db import transaction
from django.test import Client

from control import node_certs, node_tokens
from control.models import Event, Node, Profile, Replica, ServedModel
from gateway.identity import people as gateway_people
from gateway.models import ApiKey, TeamLimits, UserLimits
from llmgw_site import catalog as catalog_document
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

ACTORS = re.compile(r"\b(admin:root|cli(:[\w.-]+)?|token:ops)\b")
MINTED = re.compile(r"llmgw[-_][A-Za-z0-9_-]{6,}")


ROW_ID = re.compile(r"#\d+")
SERIAL = re.compile(r"serial [0-9a-f]+…")


def _normal(value: Any) -> Any:
    # Row ids differ between the three runs on PostgreSQL (sequences do not roll back).
    if isinstance(value, str):
        value = SERIAL.sub("serial <minted>", value)
        return ROW_ID.sub("#<id>", MINTED.sub("<minted>", ACTORS.sub("<actor>", value)))
    if isinstance(value, dict):
        return {k: "<id>" if k == "replica" else _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def events() -> list[tuple[Any, ...]]:
    return [
        (e.kind, e.subject, _normal(e.message), _normal(e.data))
        for e in Event.objects.order_by("id")
    ]


def nodes() -> list[tuple[Any, ...]]:
    return [
        (
            n.name,
            n.schedule,
            n.desired_revision,
            bool(n.token_hash),
            bool(n.token_prefix),
            bool(n.cert_serial),
            n.cert_issued_at is not None,
        )
        for n in Node.objects.order_by("name")
    ]


def replicas() -> list[tuple[Any, ...]]:
    return [
        (r.model.name, r.desired, r.observed, r.generation, r.failures)
        for r in Replica.objects.select_related("model").order_by("model__name", "id")
    ]


def catalog() -> list[tuple[Any, ...]]:
    return [
        (m.name, m.min_replicas, m.max_replicas, m.pinned, m.enabled)
        for m in ServedModel.objects.order_by("name")
    ]


def api_keys() -> list[tuple[Any, ...]]:
    return [
        (
            k.user.username,
            k.name,
            k.allowed_models,
            k.rpm_limit,
            k.budget_period,
            k.revoked_at is not None,
        )
        for k in ApiKey.objects.select_related("user").order_by("name", "id")
    ]


def limits() -> list[tuple[Any, ...]]:
    fields = ("allowed_models", "rpm_limit", "tpm_limit", "token_budget", "budget_period")
    return [
        ("user", row.user.username, *(getattr(row, f) for f in fields), row.self_service)
        for row in UserLimits.objects.select_related("user").order_by("user__username")
    ] + [
        ("team", row.team.name, *(getattr(row, f) for f in fields))
        for row in TeamLimits.objects.select_related("team").order_by("team__name")
    ]


def users() -> list[tuple[Any, ...]]:
    return [
        (
            u.username,
            u.email,
            u.first_name,
            u.last_name,
            u.is_active,
            u.is_staff,
            u.is_superuser,
            u.has_usable_password(),
            sorted(g.name for g in u.groups.all()),
            sorted(p.codename for p in u.user_permissions.all()),
        )
        for u in User.objects.prefetch_related("groups", "user_permissions").order_by("username")
    ]


def teams() -> list[tuple[Any, ...]]:
    return [
        (
            g.name,
            sorted(u.username for u in g.user_set.all()),
            sorted(p.codename for p in g.permissions.all()),
        )
        for g in Group.objects.prefetch_related("user_set", "permissions").order_by("name")
    ]


def outcome() -> dict[str, Any]:
    return {
        "users": users(),
        "teams": teams(),
        "events": events(),
        "nodes": nodes(),
        "replicas": replicas(),
        "catalog": catalog(),
        # Every field of every profile and model.
        "document": catalog_document.export(reveal_secrets=True),
        "keys": api_keys(),
        "limits": limits(),
    }


@dataclass
class World:
    admin: Client
    api: Client
    ids: dict[str, int]


def admin_client() -> Client:
    client = Client()
    client.force_login(make_user("root", superuser=True))
    return client


def api_client() -> Client:
    token = tokens.issue("ops", scope=AdminToken.Scope.WRITE).token
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def command(*args: str) -> None:
    call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())


def api_call(world: World, method: str, path: str, body: Any = None) -> None:
    send = getattr(world.api, method)
    url = f"/api/admin/v1{path}"
    response = send(url, json.dumps(body), content_type="application/json") if body else send(url)
    assert response.status_code < 300, response.content


def admin_action(world: World, changelist: str, action: str, *pks: int) -> None:
    response = world.admin.post(
        f"/admin/{changelist}/", {"action": action, "_selected_action": [str(p) for p in pks]}
    )
    assert response.status_code in {200, 302}, response.status_code


# --------------------------------------------------------------------------- starting rows


def fleet() -> dict[str, int]:
    node = make_node("gpu-1")
    node_tokens.issue_node_token("gpu-1")
    node_certs.mint_node_cert("gpu-1", Path(settings.LLMGW_CA_DIR))
    drained = make_node("gpu-2", schedule=Node.Schedule.DRAINING)
    model = make_model("llama3", max_replicas=2)
    replica = make_replica(model, [(node, [0])])
    Replica.objects.filter(pk=replica.pk).update(failures=3)
    _, key = make_key("alice", name="ci")
    bob = make_user("bob")
    team = Group.objects.create(name="research")
    team.user_set.add(key.user_id)
    gateway_people.set_user_limits(
        key.user_id, actor="setup", rpm_limit=100, allowed_models=["llama3", "qwen"]
    )
    return {
        "node": node.pk,
        "drained": drained.pk,
        "model": model.pk,
        "replica": replica.pk,
        "key": key.pk,
        "alice": key.user_id,
        "team": team.pk,
        "bob": bob.pk,
    }


def user_limits_form(world: World) -> None:
    row = UserLimits.objects.get(user_id=world.ids["alice"])
    response = world.admin.post(
        f"/admin/gateway/userlimits/{row.pk}/change/",
        {
            "allowed_models": '["qwen", "llama3", "qwen"]',
            "rpm_limit": "30",
            "tpm_limit": "",
            "token_budget": "5000",
            "budget_period": "day",
            # self_service unticked: off
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]


def team_limits_form(world: World) -> None:
    response = world.admin.post(
        "/admin/gateway/teamlimits/add/",
        {
            "team": str(world.ids["team"]),
            "allowed_models": '["llama3"]',
            "rpm_limit": "",
            "tpm_limit": "1000",
            "token_budget": "",
            "budget_period": "week",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]


def delete_user_limits_form(world: World) -> None:
    row = UserLimits.objects.get(user_id=world.ids["alice"])
    response = world.admin.post(f"/admin/gateway/userlimits/{row.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302, response.status_code


def scale_form(world: World) -> None:
    model = ServedModel.objects.get(pk=world.ids["model"])
    response = world.admin.post(
        f"/admin/control/servedmodel/{model.pk}/change/",
        {
            "name": model.name,
            "aliases": json.dumps(model.aliases),
            "source": model.source,
            "enabled": "on",
            "default_profile": str(model.default_profile_id),
            "profiles": [str(p.pk) for p in model.profiles.all()],
            "min_replicas": "1",
            "max_replicas": "3",
            "idle_timeout_s": str(model.idle_timeout_s),
            "activation_timeout_s": str(model.activation_timeout_s),
            "max_waiting": str(model.max_waiting),
            **{
                name: "" if getattr(model, name) is None else str(getattr(model, name))
                for name in ("connect_timeout_s", "first_byte_timeout_s", "stream_idle_timeout_s")
            },
            # The per-profile scales inline, with no rows (the model scales as a whole).
            "scales-TOTAL_FORMS": "0",
            "scales-INITIAL_FORMS": "0",
            "scales-MIN_NUM_FORMS": "0",
            "scales-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]


def import_catalog(document: dict[str, Any]) -> Callable[[World], object]:
    """The command's edge for a catalog entry: ``manage.py import_catalog`` reading a file."""

    def edge(world: World) -> None:
        path = Path(settings.LLMGW_CA_DIR).parent / "catalog.yaml"
        path.write_text(yaml.safe_dump(document))
        command("import_catalog", str(path))

    return edge


PROFILE = {"engine": "vllm", "args": ["--tp", "2"], "env": {"A": "1"}, "gpus_per_shard": 2,
           "gpu_memory_mib": 70000, "gpu_selector": {"gpu": "h100"},
           "placement_strategy": "spread", "startup_timeout_s": 900}  # fmt: skip
QWEN = {"source": "org/qwen", "aliases": ["q"], "context_length": 8192}
LLAMA3_EDIT = {"aliases": ["l3"], "idle_timeout_s": 60, "enabled": False}


def profile_form(world: World, name: str, fields: dict[str, Any], *, add: bool) -> None:
    if add:
        url = "/admin/control/profile/add/"
        current: dict[str, Any] = {
            "engine": "sim", "args": [], "env": {}, "gpus_per_shard": 1, "shards_per_replica": 1,
            "gpu_memory_mib": 0, "gpu_selector": {}, "placement_strategy": "binpack",
            "health_path": "/health", "startup_timeout_s": 600,
        }  # fmt: skip
    else:
        row = Profile.objects.get(name=name)
        url = f"/admin/control/profile/{row.pk}/change/"
        current = catalog_document._values(row, catalog_document._columns(Profile))
    data = {**current, **fields, "name": name}
    form = {k: json.dumps(v) if isinstance(v, list | dict) else str(v) for k, v in data.items()}
    response = world.admin.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]


def model_form(world: World, name: str, fields: dict[str, Any], *, add: bool) -> None:
    model = ServedModel.objects.filter(name=name).first()
    current = (
        {"aliases": [], "enabled": True, "min_replicas": 0, "max_replicas": 1,
         "idle_timeout_s": 900, "pinned": False, "activation_timeout_s": 600, "max_waiting": 100}
        if model is None
        else catalog_document._values(model, catalog_document._columns(ServedModel))
    )  # fmt: skip
    data = {**current, **fields}
    profile = Profile.objects.get(name=data.pop("default_profile", "llama3-sim"))
    form: dict[str, Any] = {
        "name": name,
        "default_profile": str(profile.pk),
        "profiles": [str(profile.pk)],
        "scales-TOTAL_FORMS": "0",
        "scales-INITIAL_FORMS": "0",
        "scales-MIN_NUM_FORMS": "0",
        "scales-MAX_NUM_FORMS": "1000",
    }
    for key, value in data.items():
        if isinstance(value, bool):
            if value:
                form[key] = "on"
        elif isinstance(value, list | dict):
            form[key] = json.dumps(value)
        else:
            form[key] = "" if value is None else str(value)
    if add:
        url = "/admin/control/servedmodel/add/"
    else:
        assert model is not None
        url = f"/admin/control/servedmodel/{model.pk}/change/"
    response = world.admin.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]


Edge = Callable[[World], object]


def with_team_limits(edge: Edge) -> Edge:
    """The team given limits first (the same way on every edge), then ``edge``."""

    def run(world: World) -> object:
        gateway_people.set_team_limits(world.ids["team"], actor="setup", tpm_limit=10)
        return edge(world)

    return run


def with_spare_profile(edge: Edge) -> Edge:
    """A profile no replica runs under, offered by llama3 beside its default, then ``edge``."""

    def run(world: World) -> object:
        ServedModel.objects.get(name="llama3").profiles.add(make_profile("vllm-tp2"))
        return edge(world)

    return run


def user_form(world: World, pk: int | None, fields: dict[str, Any]) -> None:
    """Django's add (``pk`` None) or change page for a user; ticked boxes are "on"."""
    url = "/admin/auth/user/add/" if pk is None else f"/admin/auth/user/{pk}/change/"
    form = {k: "on" if v is True else v for k, v in fields.items() if v is not False}
    response = world.admin.post(url, form)
    assert response.status_code == 302, response.content.decode()[:3000]


def team_form(world: World, pk: int | None, fields: dict[str, Any]) -> None:
    url = "/admin/auth/group/add/" if pk is None else f"/admin/auth/group/{pk}/change/"
    response = world.admin.post(url, fields)
    assert response.status_code == 302, response.content.decode()[:3000]


CHANGES: dict[str, tuple[Edge | None, Edge, Edge]] = {
    "cordon": (
        lambda w: admin_action(w, "control/node", "cordon", w.ids["node"]),
        lambda w: command("cordon", "gpu-1"),
        lambda w: api_call(w, "post", "/nodes/gpu-1/cordon"),
    ),
    "drain": (
        lambda w: admin_action(w, "control/node", "drain", w.ids["node"]),
        lambda w: command("drain", "gpu-1"),
        lambda w: api_call(w, "post", "/nodes/gpu-1/drain"),
    ),
    "undrain": (
        lambda w: admin_action(w, "control/node", "undrain", w.ids["drained"]),
        lambda w: command("undrain", "gpu-2"),
        lambda w: api_call(w, "post", "/nodes/gpu-2/undrain"),
    ),
    "restart": (
        lambda w: admin_action(w, "control/replica", "restart", w.ids["replica"]),
        lambda w: command("restart_replica", str(w.ids["replica"])),
        lambda w: api_call(w, "post", f"/replicas/{w.ids['replica']}/restart"),
    ),
    "issue node token": (
        lambda w: admin_action(w, "control/node", "issue_token", w.ids["drained"]),
        lambda w: command("issue_node_token", "gpu-2"),
        lambda w: api_call(w, "post", "/nodes/gpu-2/token"),
    ),
    "revoke node token": (
        lambda w: admin_action(w, "control/node", "revoke_token", w.ids["node"]),
        lambda w: command("revoke_node_token", "gpu-1"),
        lambda w: api_call(w, "delete", "/nodes/gpu-1/token"),
    ),
    "issue node certificate": (
        None,
        lambda w: command("issue_node_cert", "gpu-2"),
        lambda w: api_call(w, "post", "/nodes/gpu-2/certificate"),
    ),
    "replace node certificate": (
        None,
        lambda w: command("issue_node_cert", "gpu-1"),
        lambda w: api_call(w, "post", "/nodes/gpu-1/certificate"),
    ),
    "revoke node certificate": (
        lambda w: admin_action(w, "control/node", "revoke_cert", w.ids["node"]),
        lambda w: command("revoke_node_cert", "gpu-1"),
        lambda w: api_call(w, "delete", "/nodes/gpu-1/certificate"),
    ),
    "set user limits": (
        user_limits_form,
        lambda w: command(
            "set_limits",
            "--user",
            "alice",
            "--models",
            "qwen,llama3,qwen",
            "--rpm",
            "30",
            "--tpm",
            "none",
            "--budget",
            "5000",
            "--budget-period",
            "day",
            "--self-service",
            "off",
        ),
        lambda w: api_call(
            w,
            "patch",
            "/users/alice/limits",
            {
                "allowed_models": ["qwen", "llama3", "qwen"],
                "rpm_limit": 30,
                "tpm_limit": None,
                "token_budget": 5000,
                "budget_period": "day",
                "self_service": False,
            },
        ),
    ),
    "set team limits": (
        team_limits_form,
        lambda w: command(
            "set_limits",
            "--team",
            "research",
            "--models",
            "llama3",
            "--tpm",
            "1000",
            "--budget-period",
            "week",
        ),
        lambda w: api_call(
            w,
            "patch",
            "/teams/research/limits",
            {"allowed_models": ["llama3"], "tpm_limit": 1000, "budget_period": "week"},
        ),
    ),
    "clear user limits": (
        delete_user_limits_form,
        lambda w: command("set_limits", "--user", "alice", "--clear"),
        lambda w: api_call(w, "delete", "/users/alice/limits"),
    ),
    "clear team limits": (
        with_team_limits(
            lambda w: w.admin.post(
                f"/admin/gateway/teamlimits/{TeamLimits.objects.get().pk}/delete/", {"post": "yes"}
            )
        ),
        with_team_limits(lambda w: command("set_limits", "--team", "research", "--clear")),
        with_team_limits(lambda w: api_call(w, "delete", "/teams/research/limits")),
    ),
    "create profile": (
        lambda w: profile_form(w, "vllm-tp2", PROFILE, add=True),
        import_catalog({"profiles": [{"name": "vllm-tp2", **PROFILE}]}),
        lambda w: api_call(w, "post", "/profiles", {"name": "vllm-tp2", **PROFILE}),
    ),
    "update profile": (
        lambda w: profile_form(
            w, "llama3-sim", {"gpus_per_shard": 2, "env": {"B": "2"}}, add=False
        ),
        import_catalog(
            {"profiles": [{"name": "llama3-sim", "gpus_per_shard": 2, "env": {"B": "2"}}]}
        ),
        lambda w: api_call(
            w, "patch", "/profiles/llama3-sim", {"gpus_per_shard": 2, "env": {"B": "2"}}
        ),
    ),
    "create model": (
        lambda w: model_form(w, "qwen", QWEN, add=True),
        import_catalog({"models": [{"name": "qwen", "default_profile": "llama3-sim", **QWEN}]}),
        lambda w: api_call(
            w, "post", "/models", {"name": "qwen", "default_profile": "llama3-sim", **QWEN}
        ),
    ),
    "update model": (
        lambda w: model_form(w, "llama3", LLAMA3_EDIT, add=False),
        import_catalog(
            {"models": [{"name": "llama3", "default_profile": "llama3-sim", **LLAMA3_EDIT}]}
        ),
        lambda w: api_call(w, "patch", "/models/llama3", LLAMA3_EDIT),
    ),
    "scale": (
        scale_form,
        lambda w: command("scale_model", "llama3", "--min", "1", "--max", "3"),
        lambda w: api_call(
            w, "post", "/models/llama3/scale", {"min_replicas": 1, "max_replicas": 3}
        ),
    ),
    "pin": (
        lambda w: admin_action(w, "control/servedmodel", "pin", w.ids["model"]),
        lambda w: command("pin_model", "llama3"),
        lambda w: api_call(w, "post", "/models/llama3/pin", {"pinned": True}),
    ),
    # The same two changes as a model's fields in the API's update of the whole entry: still
    # the operator's change (the Event, who made it), not a silent row update.
    "scale through the entry": (
        scale_form,
        lambda w: command("scale_model", "llama3", "--min", "1", "--max", "3"),
        lambda w: api_call(w, "patch", "/models/llama3", {"min_replicas": 1, "max_replicas": 3}),
    ),
    "pin through the entry": (
        lambda w: admin_action(w, "control/servedmodel", "pin", w.ids["model"]),
        lambda w: command("pin_model", "llama3"),
        lambda w: api_call(w, "patch", "/models/llama3", {"pinned": True, "idle_timeout_s": 900}),
    ),
    "delete model": (
        lambda w: w.admin.post(
            "/admin/control/servedmodel/",
            {
                "action": "delete_selected",
                "_selected_action": [str(w.ids["model"])],
                "post": "yes",
            },
        ),
        lambda w: command("delete_model", "llama3"),
        lambda w: api_call(w, "delete", "/models/llama3"),
    ),
    "issue api key": (
        lambda w: w.admin.post(
            "/admin/gateway/apikey/add/",
            {
                "user": str(ApiKey.objects.get(pk=w.ids["key"]).user_id),
                "name": "new",
                "allowed_models": '["llama3"]',
                "rpm_limit": "60",
                "budget_period": "week",
            },
        ),
        lambda w: command(
            "create_api_key",
            "alice",
            "--name",
            "new",
            "--models",
            "llama3",
            "--rpm",
            "60",
            "--budget-period",
            "week",
        ),
        lambda w: api_call(
            w,
            "post",
            "/keys",
            {
                "user": "alice",
                "name": "new",
                "models": ["llama3"],
                "rpm_limit": 60,
                "budget_period": "week",
            },
        ),
    ),
    "create user": (
        lambda w: user_form(
            w,
            None,
            {
                "username": "carol",
                "usable_password": "false",
                "email": "carol@example.com",
                "is_staff": True,
                "groups": [str(w.ids["team"])],
            },
        ),
        lambda w: command(
            "create_user", "carol", "--email", "carol@example.com", "--staff", "--teams", "research"
        ),
        lambda w: api_call(
            w,
            "post",
            "/users",
            {
                "username": "carol",
                "email": "carol@example.com",
                "is_staff": True,
                "teams": ["research"],
            },
        ),
    ),
    "update user": (
        lambda w: user_form(
            w,
            w.ids["alice"],
            {
                "first_name": "",
                "last_name": "",
                "email": "alice@example.com",
                "is_active": False,
                "is_staff": True,
                "is_superuser": False,
                # no teams (groups) and no permissions: alice leaves research
            },
        ),
        lambda w: command(
            "set_user",
            "alice",
            "--staff",
            "on",
            "--email",
            "alice@example.com",
            "--active",
            "off",
            "--teams",
            "",
        ),
        lambda w: api_call(
            w,
            "patch",
            "/users/alice",
            {"is_active": False, "teams": [], "is_staff": True, "email": "alice@example.com"},
        ),
    ),
    "create team": (
        lambda w: team_form(
            w, None, {"name": "ml", "members": [str(w.ids["bob"]), str(w.ids["alice"])]}
        ),
        lambda w: command("create_team", "ml", "--members", "bob,alice"),
        lambda w: api_call(w, "post", "/teams", {"name": "ml", "members": ["bob", "alice"]}),
    ),
    "set team members": (
        lambda w: team_form(w, w.ids["team"], {"members": [str(w.ids["bob"])]}),
        lambda w: command("set_team_members", "research", "--members", "bob"),
        lambda w: api_call(w, "put", "/teams/research/members", {"members": ["bob"]}),
    ),
    "delete team": (
        with_team_limits(
            lambda w: w.admin.post(f"/admin/auth/group/{w.ids['team']}/delete/", {"post": "yes"})
        ),
        with_team_limits(lambda w: command("delete_team", "research")),
        with_team_limits(lambda w: api_call(w, "delete", "/teams/research")),
    ),
    "delete profile": (
        with_spare_profile(
            lambda w: w.admin.post(
                f"/admin/control/profile/{Profile.objects.get(name='vllm-tp2').pk}/delete/",
                {"post": "yes"},
            )
        ),
        with_spare_profile(lambda w: command("delete_profile", "vllm-tp2")),
        with_spare_profile(lambda w: api_call(w, "delete", "/profiles/vllm-tp2")),
    ),
    "revoke api key": (
        lambda w: admin_action(w, "gateway/apikey", "revoke", w.ids["key"]),
        lambda w: command("revoke_api_key", ApiKey.objects.get(pk=w.ids["key"]).prefix),
        lambda w: api_call(w, "post", f"/keys/{w.ids['key']}/revoke"),
    ),
}


@pytest.fixture(autouse=True)
def ca_dir(tmp_path: Path, settings: Any) -> Path:
    settings.LLMGW_CA_DIR = tmp_path / "ca"
    call_command("init_ca", stdout=io.StringIO())
    return Path(settings.LLMGW_CA_DIR)


def run_edge(edge: Edge) -> tuple[dict[str, Any], dict[str, Any]]:
    """The outcome of one edge from the same starting rows, then rolled back."""
    with transaction.atomic():
        world = World(admin_client(), api_client(), fleet())
        before = outcome()
        edge(world)
        after = outcome()
        transaction.set_rollback(True)
    return before, after


@pytest.mark.parametrize("change", list(CHANGES))
def test_admin_command_and_api_leave_the_same_rows_and_events(change: str) -> None:
    by_admin_edge, by_command_edge, by_api_edge = CHANGES[change]
    before, by_command = run_edge(by_command_edge)
    _, by_api = run_edge(by_api_edge)
    assert by_command != before, f"{change}: the command changed nothing"
    assert by_api == by_command, change
    if by_admin_edge is not None:
        _, by_admin = run_edge(by_admin_edge)
        assert by_admin == by_command, change


def test_the_admins_bulk_delete_of_limits_clears_each_through_the_same_function() -> None:
    world = World(admin_client(), api_client(), fleet())
    gateway_people.set_team_limits(world.ids["team"], actor="setup", tpm_limit=10)
    for changelist, row in (
        ("userlimits", UserLimits.objects.get()),
        ("teamlimits", TeamLimits.objects.get()),
    ):
        response = world.admin.post(
            f"/admin/gateway/{changelist}/",
            {"action": "delete_selected", "_selected_action": [str(row.pk)], "post": "yes"},
        )
        assert response.status_code == 302, response.status_code
    assert not UserLimits.objects.exists() and not TeamLimits.objects.exists()
    assert [
        (e.subject, e.message)
        for e in Event.objects.filter(message__startswith="limits removed").order_by("id")
    ] == [
        ("user/alice", "limits removed by admin:root"),
        ("team/research", "limits removed by admin:root"),
    ]


def test_the_admins_bulk_delete_of_teams_and_profiles_goes_through_the_same_functions() -> None:
    world = World(admin_client(), api_client(), fleet())
    Group.objects.create(name="ml")
    with_spare_profile(lambda w: None)(world)
    make_profile("unused")
    spare = Profile.objects.exclude(name="llama3-sim")
    for changelist, pks in (
        ("auth/group", list(Group.objects.values_list("pk", flat=True))),
        ("control/profile", list(spare.values_list("pk", flat=True))),
    ):
        response = world.admin.post(
            f"/admin/{changelist}/",
            {"action": "delete_selected", "_selected_action": [str(p) for p in pks], "post": "yes"},
        )
        assert response.status_code == 302, response.status_code
    assert not Group.objects.exists()
    assert sorted(Profile.objects.values_list("name", flat=True)) == ["llama3-sim"]
    assert sorted(
        (e.subject, e.message) for e in Event.objects.filter(message__startswith="deleted by")
    ) == [
        ("profile/unused", "deleted by admin:root"),
        ("profile/vllm-tp2", "deleted by admin:root (offered by llama3)"),
        ("team/ml", "deleted by admin:root"),
        ("team/research", "deleted by admin:root (members alice)"),
    ]


def test_the_admins_user_and_group_pages_still_open() -> None:
    world = World(admin_client(), api_client(), fleet())
    for path in (
        "/admin/auth/user/",
        "/admin/auth/user/add/",
        f"/admin/auth/user/{world.ids['alice']}/change/",
        f"/admin/auth/user/{world.ids['alice']}/password/",
        "/admin/auth/group/",
        "/admin/auth/group/add/",
        f"/admin/auth/group/{world.ids['team']}/change/",
        f"/admin/auth/group/{world.ids['team']}/delete/",
    ):
        assert world.admin.get(path).status_code == 200, path


def test_permissions_set_on_the_admins_user_and_group_pages_are_in_the_audit_trail() -> None:
    world = World(admin_client(), api_client(), fleet())
    view_keys = Permission.objects.get(content_type__app_label="gateway", codename="view_apikey")
    user_form(
        world,
        world.ids["bob"],
        {"is_active": True, "is_staff": True, "user_permissions": [str(view_keys.pk)]},
    )
    team_form(
        world,
        world.ids["team"],
        {"members": [str(world.ids["alice"])], "permissions": [str(view_keys.pk)]},
    )
    assert User.objects.get(username="bob").has_perm("gateway.view_apikey")
    assert [(e.subject, e.message) for e in Event.objects.order_by("id")][-2:] == [
        (
            "user/bob",
            "changed by admin:root: is_staff False → True, permissions none → gateway.view_apikey",
        ),
        ("team/research", "changed by admin:root: permissions none → gateway.view_apikey"),
    ]
