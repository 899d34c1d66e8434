"""`manage.py run`'s quick flags: ``--endpoint id=URL=model[,model]`` (repeatable, added to
``LLMGW_STATIC_ENDPOINTS``) and ``--catalog FILE`` (applied at every start, as
``import_catalog`` applies it).

The flags' endpoints reach the web processes: each answers through a real ``sim`` engine with
the official ``openai`` client. The catalog is applied at start, the second start changes
nothing, and models added in the admin stay. Bad values stop the start, naming the flag, the
variable, the file, the entry and the field.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from django.core.management import CommandError, call_command

from control.models import Profile, ServedModel
from gateway.models import Endpoint
from tests.harness.factories import make_model
from tests.harness.live import start_sim
from tests.harness.procs import REPO_ROOT, Proc, free_port
from tests.harness.store import child_env
from tests.harness.waits import wait_until


def catalog_document(sim_port: int) -> dict[str, Any]:
    """A catalog as ``export_catalog`` writes it: a profile, a model on it, an endpoint (a
    ``sim`` engine on loopback, where a row may point only when allowed on purpose)."""
    return {
        "version": 1,
        "profiles": [{"name": "from-file-sim", "engine": "sim"}],
        "models": [
            {
                "name": "from-file",
                "source": "llmgw/from-file",
                "default_profile": "from-file-sim",
                "min_replicas": 0,
                "max_replicas": 2,
            }
        ],
        "endpoints": [
            {
                "id": "d",
                "url": f"http://127.0.0.1:{sim_port}",
                "models": ["catalog-d"],
                "allow_private_address": True,  # the sim is on loopback, on purpose
            }
        ],
    }


def start_run(tmp_path: Path, name: str, *flags: str, **env: str) -> tuple[Proc, str, int]:
    """``manage.py run --router-only`` with ``flags``, on the test database; the process, its
    banner and its port, once it answers."""
    port = free_port()
    argv = [sys.executable, "manage.py", "run", "--router-only", "--port", str(port), *flags]
    child = child_env(LLMGW_VAR_DIR=str(tmp_path / "var"), LLMGW_WEB_PROCESSES="1", **env)
    child.pop("REDIS_URL", None)
    run = Proc(name, argv, tmp_path / "logs", child, port=port).start()
    banner = wait_until(
        lambda: "Ctrl-C stops everything" in (text := run.log()) and text,
        what=f"{name}'s banner",
        logs=[run],
        running=[run],
    )
    run.wait_answering()
    return run, banner, port


def stop(run: Proc) -> None:
    run.signal(signal.SIGINT)
    run.wait(120)


def answers(port: int, banner: str, model: str) -> str:
    key = re.search(r"API key:\s+(\S+)", banner)
    assert key is not None, banner
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1), max_retries=0
    )
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}]
    )
    return reply.choices[0].message.content or ""


@pytest.mark.django_db(transaction=True)
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_endpoint_flags_and_the_catalog_reach_the_web_processes_at_every_start(
    tmp_path: Path,
) -> None:
    sim = start_sim(tmp_path / "logs", ["flag-a", "flag-b", "env-c", "catalog-d"])
    upstream = f"http://127.0.0.1:{sim.port}"
    make_model("admin-added")  # a model an operator added in the admin before
    file = tmp_path / "catalog.json"
    file.write_text(json.dumps(catalog_document(sim.port)))
    try:
        first, banner, port = start_run(
            tmp_path,
            "run-1",
            "--endpoint", f"a={upstream}=flag-a",
            "--endpoint", f"b={upstream}/=flag-b",
            "--catalog", str(file),
            LLMGW_STATIC_ENDPOINTS=f"c={upstream}=env-c",
        )  # fmt: skip
        try:
            assert f"catalog:       {file}: 3 created, 0 updated, 0 unchanged" in banner
            assert "serving:       catalog-d, env-c, flag-a, flag-b" in banner
            # The variable's endpoint and each flag's answer, and so does the file's.
            for model in ("flag-a", "flag-b", "env-c", "catalog-d"):
                assert answers(port, banner, model), model
        finally:
            stop(first)
        assert sorted(ServedModel.objects.values_list("name", flat=True)) == [
            "admin-added",
            "from-file",
        ]
        assert ServedModel.objects.get(name="from-file").max_replicas == 2
        assert list(Endpoint.objects.values_list("slug", "model_names")) == [("d", ["catalog-d"])]

        make_model("added-between")  # an operator adds another between the starts
        second, banner, port = start_run(tmp_path, "run-2", "--catalog", str(file))
        try:
            assert f"catalog:       {file}: 0 created, 0 updated, 3 unchanged" in banner
            # The flags were the first start's only: this one serves the file's endpoint.
            assert "serving:       catalog-d\n" in banner
            assert answers(port, banner, "catalog-d")
        finally:
            stop(second)
        assert sorted(ServedModel.objects.values_list("name", flat=True)) == [
            "added-between",
            "admin-added",
            "from-file",
        ]
        assert sorted(Profile.objects.values_list("name", flat=True)) == [
            "added-between-sim",
            "admin-added-sim",
            "from-file-sim",
        ]
    finally:
        sim.stop()


@pytest.mark.parametrize(
    ("variable", "flags", "message"),
    [
        ("", ["bad"], "--endpoint: 'bad' is not of the form id=URL=model[,model]"),
        ("", ["a=ftp://x=m"], "--endpoint: 'a=ftp://x=m' needs an http:// or https:// URL"),
        (
            "",
            ["a=http://10.0.0.1=m", "a=http://10.0.0.2=n"],
            "--endpoint: endpoint id 'a' appears twice",
        ),
        (
            "a=http://10.0.0.1=m",
            ["a=http://10.0.0.2=n"],
            "--endpoint: endpoint id 'a' appears twice (it is in LLMGW_STATIC_ENDPOINTS too)",
        ),
        ("bad", [], "LLMGW_STATIC_ENDPOINTS: 'bad' is not of the form id=URL=model[,model]"),
    ],
)
def test_bad_endpoints_are_refused_before_anything_starts_naming_the_flag_or_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, flags: list[str], message: str
) -> None:
    monkeypatch.setenv("LLMGW_STATIC_ENDPOINTS", variable)
    argv = [arg for value in flags for arg in ("--endpoint", value)]
    # Refused before the store is opened (this test has none) or a port bound.
    with pytest.raises(CommandError) as refused:
        call_command("run", "--router-only", "--port", "1", *argv)
    assert str(refused.value) == message


@pytest.mark.django_db(transaction=True)
@pytest.mark.e2e
def test_a_bad_catalog_file_stops_the_start_naming_the_file_the_entry_and_the_field(
    tmp_path: Path,
) -> None:
    document = catalog_document(9)
    document["models"] = [{**document["models"][0], "min_replicas": -1}]
    file = tmp_path / "catalog.yaml"
    file.write_text(json.dumps(document))  # JSON is YAML
    argv = [
        sys.executable, "manage.py", "run", "--router-only", "--port", str(free_port()),
        "--endpoint", "a=http://127.0.0.1:9=m", "--catalog", str(file),
    ]  # fmt: skip
    env = child_env(LLMGW_VAR_DIR=str(tmp_path / "var"))
    done = subprocess.run(
        argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert f"--catalog {file}: model from-file: min_replicas:" in done.stderr
    assert "(field models[0].min_replicas); nothing was imported" in done.stderr
    assert "Traceback" not in done.stderr
    # All or nothing: the file's good profile was not written either, and nothing started.
    assert not Profile.objects.exists() and not Endpoint.objects.exists()
    assert "Ctrl-C stops everything" not in done.stdout
