"""Catalog as code: ``PUT /api/admin/v1/catalog`` with the document ``export_catalog`` writes.

A dry run answers the exact changes, field by field, and writes nothing; applying is all or
nothing; applying the same document twice changes nothing the second time; an invalid
document changes nothing and names the field at fault.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.test import Client

from control.models import Profile, ServedModel
from gateway.models import Endpoint
from llmgw_site import catalog
from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from tests.harness.factories import make_model

pytestmark = pytest.mark.django_db

URL = "/api/admin/v1/catalog"

DOCUMENT: dict[str, Any] = {
    "version": 1,
    "profiles": [
        {"name": "vllm-tp2", "engine": "vllm", "gpus_per_shard": 2, "gpu_memory_mib": 70000},
        {"name": "sim", "engine": "sim"},
    ],
    "models": [
        {
            "name": "llama3-70b",
            "source": "meta-llama/Meta-Llama-3-70B-Instruct",
            "default_profile": "vllm-tp2",
            "profiles": ["vllm-tp2", "sim"],
            "min_replicas": 1,
            "max_replicas": 3,
        }
    ],
    "endpoints": [{"id": "openai-compat", "url": "http://10.0.0.5:8000", "models": ["x"]}],
}


@pytest.fixture
def client() -> Client:
    token = tokens.issue("ci", scope=AdminToken.Scope.WRITE).token
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def put(client: Client, document: Any, *, dry_run: bool = False, yaml_body: bool = False) -> Any:
    url = URL + ("?dry_run=true" if dry_run else "")
    if yaml_body:
        return client.put(url, yaml.safe_dump(document), content_type="application/yaml")
    return client.put(url, json.dumps(document), content_type="application/json")


def snapshot() -> str:
    return catalog.export_yaml(reveal_secrets=True)


def test_a_dry_run_reports_the_exact_diff_and_writes_nothing(client: Client) -> None:
    make_model("llama3-70b", profile=None, min_replicas=0, max_replicas=1, source="old/source")
    before = snapshot()
    response = put(client, DOCUMENT, dry_run=True)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["dry_run"] is True
    assert body["created"] == ["profile vllm-tp2", "profile sim", "endpoint openai-compat"]
    assert body["updated"] == ["model llama3-70b"]
    assert body["changes"]["model llama3-70b"] == {
        "source": {"from": "old/source", "to": "meta-llama/Meta-Llama-3-70B-Instruct"},
        "min_replicas": {"from": 0, "to": 1},
        "max_replicas": {"from": 1, "to": 3},
        "default_profile": {"from": "llama3-70b-sim", "to": "vllm-tp2"},
        "profiles": {"from": ["llama3-70b-sim"], "to": ["sim", "vllm-tp2"]},
    }
    assert body["changes"]["profile vllm-tp2"]["gpus_per_shard"] == {"from": None, "to": 2}
    assert snapshot() == before

    applied = put(client, DOCUMENT).json()
    assert {k: applied[k] for k in ("created", "updated", "changes")} == {
        k: body[k] for k in ("created", "updated", "changes")
    }
    model = ServedModel.objects.get(name="llama3-70b")
    assert (model.min_replicas, model.max_replicas, model.default_profile.name) == (
        1,
        3,
        "vllm-tp2",
    )


def test_applying_twice_changes_nothing_the_second_time(client: Client) -> None:
    assert put(client, DOCUMENT).json()["created"]
    after_first = snapshot()
    second = put(client, DOCUMENT).json()
    assert second["created"] == [] and second["updated"] == [] and second["changes"] == {}
    assert len(second["unchanged"]) == 4
    assert snapshot() == after_first


def test_the_export_is_a_document_the_put_takes_back_unchanged(client: Client) -> None:
    put(client, DOCUMENT)
    exported = client.get(URL).json()
    out = io.StringIO()
    call_command("export_catalog", stdout=out)
    assert yaml.safe_load(out.getvalue()) == exported
    again = put(client, exported, yaml_body=True).json()
    assert again["updated"] == [] and again["created"] == []


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["models"][0].update(max_replicas=-1), "models[0].max_replicas"),
        (lambda d: d["models"][0].update(min_replicas=9), "models[0].min_replicas"),
        (lambda d: d["models"][0].update(default_profile="nope"), "models[0].default_profile"),
        (lambda d: d["models"][0].update(profiles=["sim", "gone"]), "models[0].profiles[1]"),
        (lambda d: d["profiles"][1].update(colour="red"), "profiles[1].colour"),
        (lambda d: d["profiles"][0].update(env={"BAD NAME": "x"}), "profiles[0].env"),
        (lambda d: d["profiles"][1].pop("name"), "profiles[1].name"),
        (lambda d: d["endpoints"][0].update(url="file:///etc/passwd"), "endpoints[0].url"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(nodes=[]), "nodes"),
        (lambda d: d.update(models={"name": "x"}), "models"),
    ],
)
def test_an_invalid_document_changes_nothing_and_names_the_field(
    client: Client, mutate: Any, field: str
) -> None:
    make_model("existing")
    before = snapshot()
    document = json.loads(json.dumps(DOCUMENT))
    mutate(document)
    response = put(client, document)
    assert response.status_code == 422, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid" and error["field"] == field, error
    assert snapshot() == before
    assert not Profile.objects.filter(name="vllm-tp2").exists()  # the valid part neither


def test_a_document_that_is_not_json_or_yaml_is_refused(client: Client) -> None:
    response = client.put(URL, b"\xff{", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_document"
    assert not Endpoint.objects.exists()


def test_a_read_only_token_may_dry_run_nothing(client: Client) -> None:
    reader = Client(HTTP_AUTHORIZATION=f"Bearer {tokens.issue('ro').token}")
    response = put(reader, DOCUMENT, dry_run=True)
    assert response.status_code == 403 and response.json()["error"]["code"] == "read_only"
