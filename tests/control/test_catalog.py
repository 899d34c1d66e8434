"""Catalog YAML: export and import are inverse, import is idempotent and all-or-nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml
from django.db import connection

from control import profiles
from control.models import Profile, ServedModel
from gateway.models import Endpoint
from llmgw_site import catalog
from llmgw_site.catalog import CatalogError, ImportResult
from tests.harness.store import execute_now, table_locked
from tests.harness.waits import wait_until

pytestmark = pytest.mark.django_db

CATALOG = """
version: 1
profiles:
  - name: vllm-tp2
    engine: vllm
    args: ["--model", "{source}", "--port", "{port}", "--tensor-parallel-size", "2"]
    env: {HF_HOME: /data/hf}
    gpus_per_shard: 2
    gpu_memory_mib: 70000
    gpu_selector: {gpu: h100}
  - name: sim
    engine: sim
models:
  - name: llama3-70b
    aliases: [llama3]
    source: meta-llama/Meta-Llama-3-70B-Instruct
    default_profile: vllm-tp2
    profiles: [vllm-tp2, sim]
    min_replicas: 1
    max_replicas: 3
    pinned: true
endpoints:
  - id: openai-compat
    url: http://10.0.0.5:8000
    models: [llama3-70b]
    weight: 3
"""


def test_import_creates_every_entry() -> None:
    result = catalog.import_yaml(CATALOG)
    assert result.created == [
        "profile vllm-tp2",
        "profile sim",
        "model llama3-70b",
        "endpoint openai-compat",
    ]
    model = ServedModel.objects.get()
    assert model.default_profile.name == "vllm-tp2"
    assert sorted(p.name for p in model.profiles.all()) == ["sim", "vllm-tp2"]
    assert model.aliases == ["llama3"] and model.pinned and model.max_replicas == 3
    profile = Profile.objects.get(name="vllm-tp2")
    assert profile.env == {"HF_HOME": "/data/hf"} and profile.gpus_per_shard == 2
    assert Endpoint.objects.get().weight == 3


def test_importing_the_same_file_twice_changes_nothing_the_second_time() -> None:
    catalog.import_yaml(CATALOG)
    again = catalog.import_yaml(CATALOG)
    assert again.created == [] and again.updated == []
    assert len(again.unchanged) == 4


def test_export_then_import_into_an_empty_catalog_gives_the_same_export() -> None:
    catalog.import_yaml(CATALOG)
    exported = catalog.export_yaml(reveal_secrets=True)
    ServedModel.objects.all().delete()
    Profile.objects.all().delete()
    Endpoint.objects.all().delete()
    catalog.import_yaml(exported)
    assert catalog.export_yaml(reveal_secrets=True) == exported
    assert yaml.safe_load(exported)["models"][0]["profiles"] == ["sim", "vllm-tp2"]


def test_a_changed_field_or_profile_list_is_an_update() -> None:
    catalog.import_yaml(CATALOG)
    result = catalog.import_yaml(CATALOG.replace("max_replicas: 3", "max_replicas: 4"))
    assert result.updated == ["model llama3-70b"]
    assert ServedModel.objects.get().max_replicas == 4

    only_sim = CATALOG.replace("max_replicas: 3", "max_replicas: 4").replace(
        "profiles: [vllm-tp2, sim]", "profiles: [vllm-tp2]"
    )
    assert catalog.import_yaml(only_sim).updated == ["model llama3-70b"]
    assert [p.name for p in ServedModel.objects.get().profiles.all()] == ["vllm-tp2"]


def test_the_default_profile_is_always_among_a_models_profiles() -> None:
    catalog.import_yaml(CATALOG.replace("profiles: [vllm-tp2, sim]", "profiles: [sim]"))
    names = sorted(p.name for p in ServedModel.objects.get().profiles.all())
    assert names == ["sim", "vllm-tp2"]


def test_a_bad_entry_leaves_the_catalog_as_it_was() -> None:
    catalog.import_yaml(CATALOG)
    broken = CATALOG.replace("max_replicas: 3", "max_replicas: 5").replace(
        "url: http://10.0.0.5:8000", "url: http://169.254.169.254/"
    )
    with pytest.raises(CatalogError, match=r"endpoint openai-compat: url: .*link-local"):
        catalog.import_yaml(broken)
    assert ServedModel.objects.get().max_replicas == 3
    assert Endpoint.objects.get().url == "http://10.0.0.5:8000"


def test_dry_run_writes_nothing() -> None:
    result = catalog.import_yaml(CATALOG, dry_run=True)
    assert len(result.created) == 4
    assert not Profile.objects.exists() and not ServedModel.objects.exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("profiles: [{name: p, colour: red}]", "profile p: unknown field 'colour'"),
        ("profiles: [{name: p, env: {'BAD NAME': x}}]", "profile p: env: .*invalid variable name"),
        ("profiles: [{name: p, args: [1, 2]}]", "profile p: args: must be a list of strings"),
        ("profiles: [{name: p, gpus_per_shard: lots}]", "profile p.gpus_per_shard: .*integer"),
        ("profiles: [{engine: sim}]", r"profiles\[0\]: needs a 'name'"),
        ("models: [{name: m, source: s}]", "model m: needs a 'default_profile'"),
        (
            "profiles: [{name: p}]\nmodels: [{name: m, source: s, default_profile: p, "
            "min_replicas: 3, max_replicas: 1}]",
            "model m: .*model_min_replicas_within_max",
        ),
        ("endpoints: [{id: e, url: 'file:///etc/passwd', models: [m]}]", "endpoint e: url"),
        ("nodes: []", "unknown top-level keys: nodes"),
        ("version: 2", "version 2 is not 1"),
        ("- just a list", "must be a mapping"),
        ("profiles: {name: p}", "profiles: must be a list of mappings"),
        ("profiles: [name: p", "not valid YAML"),
    ],
)
def test_bad_files_are_refused_with_a_message_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        catalog.import_yaml(text)
    assert not Profile.objects.exists()


def test_wire_problems_agree_with_what_the_agent_accepts() -> None:
    ok = profiles.wire_problems(
        args=["--port", "{port}"], env={"A_B": "1"}, health_path="/health", gpu_selector={}
    )
    assert ok == {}
    bad = profiles.wire_problems(args=[], env={}, health_path="health", gpu_selector={})
    assert "health_path" in bad


def test_replica_counts_under_other_profiles_round_trip_and_are_checked() -> None:
    with_counts = CATALOG.replace(
        "    pinned: true\n",
        "    pinned: true\n    profile_replicas: {sim: {min_replicas: 1, max_replicas: 2}}\n",
    )
    catalog.import_yaml(with_counts)
    model = ServedModel.objects.get()
    (scale,) = model.scales.all()
    assert (scale.profile.name, scale.min_replicas, scale.max_replicas) == ("sim", 1, 2)
    exported = catalog.export_yaml(reveal_secrets=True)
    assert yaml.safe_load(exported)["models"][0]["profile_replicas"] == {
        "sim": {"min_replicas": 1, "max_replicas": 2}
    }
    assert catalog.import_yaml(exported).updated == []
    assert catalog.import_yaml(CATALOG).updated == [], "a file without the key leaves them"
    assert model.scales.count() == 1

    for bad, message in [
        ("{vllm-tp2: {min_replicas: 0, max_replicas: 1}}", "not one of its other profiles"),
        ("{sim: {min_replicas: 3, max_replicas: 1}}", "min_replicas <= max_replicas"),
        ("[sim]", "must map profile names"),
    ]:
        text = CATALOG.replace(
            "    pinned: true\n", f"    pinned: true\n    profile_replicas: {bad}\n"
        )
        with pytest.raises(CatalogError, match=message):
            catalog.import_yaml(text)


def test_a_models_context_length_round_trips_and_must_be_positive() -> None:
    with_context = CATALOG.replace(
        "    pinned: true\n", "    pinned: true\n    context_length: 8192\n"
    )
    catalog.import_yaml(with_context)
    assert ServedModel.objects.get().context_length == 8192
    exported = catalog.export_yaml(reveal_secrets=True)
    assert yaml.safe_load(exported)["models"][0]["context_length"] == 8192
    assert catalog.import_yaml(exported).updated == []
    with pytest.raises(CatalogError, match="context_length"):
        catalog.import_yaml(with_context.replace("context_length: 8192", "context_length: 0"))
    assert ServedModel.objects.get().context_length == 8192


def test_a_json_file_imports_as_the_same_catalog_in_yaml_does(tmp_path: Path) -> None:
    as_json = tmp_path / "catalog.json"
    as_json.write_text(json.dumps(yaml.safe_load(CATALOG), indent="\t"))  # tabs: not YAML
    assert len(catalog.import_file(as_json).created) == 4
    as_yaml = tmp_path / "catalog.yaml"
    as_yaml.write_text(CATALOG)
    assert len(catalog.import_file(as_yaml).unchanged) == 4
    as_json.write_text('{"models": [')
    with pytest.raises(CatalogError, match="not valid JSON"):
        catalog.import_file(as_json)


@pytest.mark.django_db(transaction=True)
def test_two_imports_racing_end_with_the_rows_of_one_and_neither_fails() -> None:
    """Two control planes applying the same ``--catalog`` file as they start. On PostgreSQL
    both are held at their first insert until each has read that no row exists, so both insert
    the same names: the unique constraints decide, and the loser runs again over the winner's
    rows. (SQLite takes the write lock when a transaction begins: the second waits its turn.)"""
    results: list[ImportResult] = []
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def apply() -> None:
        try:
            start.wait()
            results.append(catalog.import_yaml(CATALOG))
        except BaseException as exc:
            failures.append(exc)
        finally:
            connection.close()

    def race() -> list[threading.Thread]:
        threads = [threading.Thread(target=apply) for _ in range(2)]
        for thread in threads:
            thread.start()
        if connection.vendor == "postgresql":
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO \"control_profile\"%%'"
            )
            wait_until(lambda: execute_now(waiting)[0] == 2, what="both imports at one insert")
        return threads

    if connection.vendor == "postgresql":
        # Reads pass a SHARE lock; inserts wait for it.
        with table_locked("control_profile", mode="SHARE"):
            threads = race()
    else:
        threads = race()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert sorted(len(r.created) for r in results) == [0, 4]
    assert sorted(len(r.unchanged) for r in results) == [0, 4]
    assert sorted(Profile.objects.values_list("name", flat=True)) == ["sim", "vllm-tp2"]
    model = ServedModel.objects.get()
    assert sorted(p.name for p in model.profiles.all()) == ["sim", "vllm-tp2"]
    assert list(Endpoint.objects.values_list("slug", flat=True)) == ["openai-compat"]
