"""llmgw installed as users install Python servers: the two wheels ``make dist`` builds, each
in a fresh virtualenv of its own (from the package index, at the lockfile's versions), started
from a directory that is not the checkout.

- ``llmgw-agent`` alone, without Django, runs a model for a control plane of tests/harness:
  it connects, is sent a replica, and its ``sim`` engine answers through the gateway.
- ``llmgw``: ``llmgw run`` answers ``/healthz``, serves the templates and static files the
  wheel carries, keeps its store in the user's data folder, and its local agent serves the
  demo model.

The wheels are built once per test session, and both environments installed side by side.
"""

from __future__ import annotations

import ast
import json
import re
import signal
import sqlite3
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from packaging.requirements import Requirement

import agents
from tests.harness.cluster import Cluster, ready_replicas
from tests.harness.factories import make_key, make_model
from tests.harness.procs import PYTHON, REPO_ROOT, Proc, free_port, port_window
from tests.harness.waits import wait_until

VERSION = "0.1.0"
# What agents/ imports beyond the standard library, by the distribution that provides it.
AGENT_IMPORTS = {
    "websockets": "websockets",
    "grpc": "grpcio",
    "google": "protobuf",
    "httpx": "httpx",
}


def project(path: Path) -> dict[str, Any]:
    return dict(tomllib.loads(path.read_text())["project"])


def requirement_lines(path: Path) -> list[Requirement]:
    """requirements.in's requirements, without their reasons."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def key(requirement: Requirement) -> tuple[str, str, frozenset[str]]:
    name = re.sub(r"[-_.]+", "-", requirement.name).lower()
    return name, str(requirement.specifier), frozenset(requirement.extras)


# --------------------------------------------------------------------------- the metadata


def test_the_products_dependencies_are_requirements_in() -> None:
    declared = [Requirement(r) for r in project(REPO_ROOT / "pyproject.toml")["dependencies"]]
    wanted = requirement_lines(REPO_ROOT / "requirements.in")
    assert sorted(map(key, declared)) == sorted(map(key, wanted))


def test_the_agents_dependencies_are_what_it_imports_at_requirements_ins_bounds() -> None:
    imported: set[str] = set()
    for source in (REPO_ROOT / "agents").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    outside = imported - set(sys.stdlib_module_names) - {"agents", "__future__"}
    assert outside == set(AGENT_IMPORTS)
    declared = {
        key(Requirement(r)) for r in project(REPO_ROOT / "agents/pyproject.toml")["dependencies"]
    }
    bounds = set(map(key, requirement_lines(REPO_ROOT / "requirements.in")))
    assert {name for name, _, _ in declared} == set(AGENT_IMPORTS.values())
    assert declared <= bounds


def test_both_wheels_carry_the_version_the_code_reports() -> None:
    from django.conf import settings

    assert project(REPO_ROOT / "pyproject.toml")["version"] == settings.LLMGW_VERSION == VERSION
    assert agents.__version__ == VERSION  # llmgw-agent's version is read from agents/__init__.py


# --------------------------------------------------------------------------- built and installed


def wait_all(*commands: list[str], cwd: Path) -> None:
    """Run ``commands`` side by side (each mostly waits on the network or a disk); fail with
    the output of any that failed."""
    running = [
        (c, subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for c in commands
    ]
    for command, proc in running:
        output, _ = proc.communicate(timeout=540)
        assert proc.returncode == 0, f"{' '.join(command)}:\n{output.decode(errors='replace')}"


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both wheels, as ``make dist`` builds them (its build tool, its two projects)."""
    out = tmp_path_factory.mktemp("dist")
    build = [PYTHON, "-m", "build", "--wheel", "--outdir", str(out)]
    wait_all([*build, "."], [*build, "agents"], cwd=REPO_ROOT)
    found = {
        "llmgw": out / f"llmgw-{VERSION}-py3-none-any.whl",
        "llmgw-agent": out / f"llmgw_agent-{VERSION}-py3-none-any.whl",
    }
    assert sorted(out.iterdir()) == sorted(found.values())
    return found


@pytest.fixture(scope="session")
def installed(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A fresh virtualenv for each wheel (its bin/ by name), with what the wheel asks for
    resolved from the package index at the versions requirements.txt pins."""
    root = tmp_path_factory.mktemp("installed")
    pins = root / "constraints.txt"
    # A constraint names a version only: no hashes and no extras.
    pins.write_text(
        "".join(
            re.sub(r"\[[^]]*\]", "", line.split()[0]) + "\n"
            for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
            if re.match(r"^[A-Za-z0-9]", line)
        )
    )
    bins = {}
    commands = []
    for name, wheel in wheels.items():
        venv = root / name
        subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
        bins[name] = venv / "bin"
        # This pip, run for that interpreter: a fresh environment need not carry one.
        pip = [PYTHON, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
        commands.append(
            [*pip, "--quiet", "--disable-pip-version-check", "-c", str(pins), str(wheel)]
        )
    wait_all(*commands, cwd=root)
    return bins


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment with nothing of the checkout's or the test run's in it."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", **extra}


def distributions(python: Path) -> set[str]:
    listing = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; "
         "print(' '.join(d.metadata['Name'].lower() for d in m.distributions()))"],
        capture_output=True, text=True, check=True, cwd="/",
    )  # fmt: skip
    return set(listing.stdout.split())


@pytest.fixture
def agent_cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "cluster")
    try:
        cluster.start_redis()
        cluster.add_control_plane()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_the_agent_wheel_without_django_runs_a_model_for_a_control_plane(
    installed: dict[str, Path], agent_cluster: Cluster, tmp_path: Path
) -> None:
    bin_dir = installed["llmgw-agent"]
    have = distributions(bin_dir / "python")
    assert "llmgw-agent" in have and {"websockets", "grpcio", "protobuf", "httpx"} <= have
    assert not have & {"django", "llmgw", "celery", "channels"}, sorted(have)
    no_django = subprocess.run(
        [str(bin_dir / "python"), "-c", "import django"], cwd="/", capture_output=True, check=False
    )
    assert b"No module named 'django'" in no_django.stderr

    make_model("wheel-model", min_replicas=1, max_replicas=1)
    agent = agent_cluster.add_agent("wheel-node", program=[str(bin_dir / "llmgw-agent")])
    assert agent.proc is not None
    wait_until(
        lambda: ready_replicas("wheel-model") == 1,
        timeout=120,
        what="the installed agent's replica ready",
        logs=agent_cluster.processes(),
        running=[agent.proc],
    )
    # Its engine is the installed package's sim, run by the installed interpreter.
    ((pid,),) = agent.engines().values()
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[:3] == [str(bin_dir / "python").encode(), b"-m", b"agents.sim"], argv
    plane = agent_cluster.control_planes[0]
    api_key, _ = make_key()
    client = openai.OpenAI(base_url=f"{plane.url}/v1", api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="wheel-model", messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.choices[0].message.content


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_llmgw_wheel_runs_from_any_directory_and_answers_healthz(
    installed: dict[str, Path], tmp_path: Path
) -> None:
    bin_dir = installed["llmgw"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    low, high = port_window()
    env = clean_env(
        tmp_path / "home",
        XDG_DATA_HOME=str(tmp_path / "data"),
        SECRET_KEY="llmgw-checks-only-not-a-secret",
        LLMGW_HTTPS="false",
        LLMGW_WEB_PROCESSES="1",
        LLMGW_PORT_RANGE=f"{low}-{high}",
    )
    commands = subprocess.run(
        [str(bin_dir / "llmgw"), "help"], cwd=elsewhere, env=env, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    ours = re.search(r"\[llmgw_site\]\n((?:    \S+\n)+)", commands.stdout)
    assert ours is not None, commands.stdout
    assert {"export_catalog", "import_catalog", "migrate", "run"} <= set(ours.group(1).split())

    port = free_port()
    run = Proc("llmgw-run", [str(bin_dir / "llmgw"), "run", "--port", str(port)],
               tmp_path / "logs", env, port=port, cwd=elsewhere)  # fmt: skip
    run.start()
    try:
        run.wait_answering("/healthz", timeout=120)
        with urllib.request.urlopen(f"{run.url}/healthz", timeout=10) as answer:
            assert json.load(answer) == {
                "status": "ok",
                "version": VERSION,
                "database": "reachable",
            }
        # The templates and the static files, from inside the installed package.
        with urllib.request.urlopen(f"{run.url}/account/login/", timeout=30) as answer:
            assert "Sign in to llmgw" in answer.read().decode()
        with urllib.request.urlopen(f"{run.url}/static/llmgw/llmgw.css", timeout=30) as answer:
            assert answer.read() == (REPO_ROOT / "static/llmgw/llmgw.css").read_bytes()
        # The store is the user's, wherever the command was started.
        store = tmp_path / "data" / "llmgw" / "llmgw.sqlite3"
        assert store.is_file() and not (elsewhere / "var").exists()

        def local_node() -> str | None:
            with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
                row = db.execute("SELECT health FROM control_node WHERE name = 'local'").fetchone()
            return row[0] if row else None

        wait_until(lambda: local_node() == "ready", what="the local agent's node", logs=[run])
        banner = run.log()
        api_key = re.search(r"API key:\s+(\S+)", banner)
        assert api_key is not None, banner
        client = openai.OpenAI(base_url=f"{run.url}/v1", api_key=api_key.group(1), max_retries=0)
        reply = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hello"}], timeout=120
        )
        assert reply.choices[0].message.content
    finally:
        run.signal(signal.SIGINT)
        assert run.wait(120) == 0, run.tail()
