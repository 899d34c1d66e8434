"""Three edges, one behaviour: each operator change made through the admin, through its
``manage.py`` command and through the admin API leaves the same rows and the same Events.

Each edge runs on the same starting rows inside a savepoint that is rolled back after the
outcome is read, so the three outcomes are compared on equal terms. Who did it differs by edge
(``admin:root``, ``cli:…``, ``token:ops``) and is normalised; so are the parts a change mints
afresh each time (a token's prefix), which are checked to be there.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from django.test import Client

from control import node_tokens
from control.models import Event, Node, Replica, ServedModel
from gateway.models import ApiKey
from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from tests.harness.factories import make_key, make_model, make_node, make_replica, make_user

pytestmark = pytest.mark.django_db

ACTORS = re.compile(r"\b(admin:root|cli(:[\w.-]+)?|token:ops)\b")
MINTED = re.compile(r"llmgw[-_][A-Za-z0-9_-]{6,}")


ROW_ID = re.compile(r"#\d+")


def _normal(value: Any) -> Any:
    # Row ids differ between the three runs on PostgreSQL (sequences do not roll back).
    if isinstance(value, str):
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
        (n.name, n.schedule, n.desired_revision, bool(n.token_hash), bool(n.token_prefix))
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


def outcome() -> dict[str, Any]:
    return {
        "events": events(),
        "nodes": nodes(),
        "replicas": replicas(),
        "catalog": catalog(),
        "keys": api_keys(),
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
    drained = make_node("gpu-2", schedule=Node.Schedule.DRAINING)
    model = make_model("llama3", max_replicas=2)
    replica = make_replica(model, [(node, [0])])
    Replica.objects.filter(pk=replica.pk).update(failures=3)
    _, key = make_key("alice", name="ci")
    return {
        "node": node.pk,
        "drained": drained.pk,
        "model": model.pk,
        "replica": replica.pk,
        "key": key.pk,
    }


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
            # The counts under its other profiles (an inline of its own): none here.
            "scales-TOTAL_FORMS": "0",
            "scales-INITIAL_FORMS": "0",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]


Edge = Callable[[World], object]

CHANGES: dict[str, tuple[Edge, Edge, Edge]] = {
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
    "revoke api key": (
        lambda w: admin_action(w, "gateway/apikey", "revoke", w.ids["key"]),
        lambda w: command("revoke_api_key", ApiKey.objects.get(pk=w.ids["key"]).prefix),
        lambda w: api_call(w, "post", f"/keys/{w.ids['key']}/revoke"),
    ),
}


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
    (before, by_admin), (_, by_command), (_, by_api) = (run_edge(edge) for edge in CHANGES[change])
    assert by_admin != before, f"{change}: the admin changed nothing"
    assert by_command == by_admin, change
    assert by_api == by_admin, change
