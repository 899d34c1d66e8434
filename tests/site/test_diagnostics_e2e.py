"""``manage.py run`` with two web processes, the worker, beat and the local agent, an admin
listener, and ``LLMGW_LOG_FORMAT=json``, as an operator at 3 a.m. finds it: the admin
listener's diagnostics gather every process of the deployment (not only the web process that
took the connection), ``manage.py diagnose`` prints the same from a shell, the client port
never serves them, and every line every process logs is one JSON object.

A test process doing known things (``tests.harness.diagnosed``: a busy thread, a leak) answers
in the same folder, so that the profile and the heap have something to find; llmgw's own
processes are checked for what they are (their pids, roles, threads, tasks, memory, lag)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.diagnosed import Diagnosed, started
from tests.harness.live import http
from tests.harness.procs import REPO_ROOT, Proc, free_port, port_open, port_window
from tests.harness.store import process_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LINE_FIELDS = {"time", "level", "logger", "message", "pid", "process"}


@dataclass
class Deployment:
    run: Proc
    errors: Path  # what every process of the deployment wrote to standard error
    client: str
    admin: str
    token: str
    env: dict[str, str]
    var: Path
    diagnosed: Diagnosed | None = None

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(REPO_ROOT / "manage.py"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO_ROOT,
            timeout=120,
        )

    def get(self, path: str, **query: object) -> tuple[int, Any]:
        url = self.admin + path + ("?" + "&".join(f"{k}={v}" for k, v in query.items()))
        status, _, body = http("GET", url, key=self.token)
        return status, json.loads(body) if body.startswith(b"{") else body.decode()

    def children(self) -> dict[str, int]:
        """The pids of run's web processes, worker and beat, from its log lines."""
        found: dict[str, int] = {}
        for line in json_lines(self.errors):
            match = re.fullmatch(
                r"started (web-\d|worker|beat|agent) \(pid (\d+)\)", line["message"]
            )
            if match:
                found[match.group(1)] = int(match.group(2))
        return found


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("diagnostics-e2e")
    port, admin_port = free_port(), free_port()
    env = process_env(
        LLMGW_VAR_DIR=str(tmp / "var"),
        DATABASE_URL=f"sqlite:///{tmp / 'run.sqlite3'}",
        LLMGW_WEB_PROCESSES="2",
        LLMGW_LOG_FORMAT="json",
        LLMGW_SHUTDOWN_GRACE="5",
        LLMGW_PORT_RANGE="{}-{}".format(*port_window()),
        # Celery's own INFO lines too (its default is WARNING), so that the worker and beat
        # are seen to write some: every process's lines are checked below.
        CELERY_WORKER_LOGLEVEL="INFO",
        CELERY_BEAT_LOGLEVEL="INFO",
    )
    env.pop("REDIS_URL", None)
    errors = tmp / "run.stderr"
    deployment = Deployment(
        Proc("run", [], tmp / "logs", env), errors, f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{admin_port}", "", env, tmp / "var",
    )  # fmt: skip
    assert deployment.manage("migrate", "--verbosity", "0").returncode == 0
    issued = deployment.manage("create_admin_token", "oncall")  # read-only: enough to look
    deployment.token = re.search(r"llmgw-admin-\S+", issued.stdout).group(0)  # type: ignore[union-attr]
    # The banner (standard output) is for the person who started it; the log is the rest.
    command = (
        f"exec {sys.executable} manage.py run --web-processes 2 --port {port} "
        f"--admin-listen {admin_port} 2> {errors}"
    )
    deployment.run = Proc("run", ["/bin/sh", "-c", command], tmp / "logs", env).start()
    folder = tmp / "var" / "diagnostics"
    try:
        wait_until(lambda: "Ctrl-C stops everything" in deployment.run.log(), what="the banner",
                   logs=[deployment.run], running=[deployment.run])  # fmt: skip
        wait_until(lambda: port_open(admin_port), what="the admin listener")
        # Two web processes, the worker and beat, each on its channel.
        wait_until(lambda: len(list(folder.glob("*.sock"))) == 4, what="four channels",
                   logs=[deployment.run], running=[deployment.run])  # fmt: skip
        with started(folder, tmp / "diagnosed") as diagnosed:
            deployment.diagnosed = diagnosed
            yield deployment
    finally:
        deployment.run.stop(timeout=60)


def answers_by_role(answers: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    roles: dict[str, list[dict[str, Any]]] = {}
    for answer in answers:
        assert "answer" in answer, answer
        roles.setdefault(answer["role"], []).append(answer)
    return roles


def test_the_stacks_come_from_every_process_of_the_deployment(deployment: Deployment) -> None:
    children = deployment.children()
    status, body = deployment.get("/admin/diagnostics/stacks")
    assert status == 200
    roles = answers_by_role(body["processes"])
    assert {a["pid"] for a in roles["web"]} == {children["web-1"], children["web-2"]}
    assert [a["pid"] for a in roles["worker"]] == [children["worker"]]
    assert [a["pid"] for a in roles["beat"]] == [children["beat"]]
    assert deployment.diagnosed is not None
    assert [a["pid"] for a in roles["test"]] == [deployment.diagnosed.proc.pid]
    for web in roles["web"]:
        threads = {t["name"] for t in web["answer"]["threads"]}
        assert {"MainThread", "llmgw diagnostics channel"} <= threads
        # The event loop's tasks: uvicorn's server, and the request asking for the stacks
        # in the one process that took it.
        assert "Server.serve" in {t["coroutine"] for t in web["answer"]["tasks"]}
    for celery in (*roles["worker"], *roles["beat"]):
        main = next(t for t in celery["answer"]["threads"] if t["name"] == "MainThread")
        assert any("celery" in frame["file"] for frame in main["frames"])
        assert celery["answer"]["tasks"] == []  # no event loop
    text = deployment.get("/admin/diagnostics/stacks.txt")[1]
    for pid in children.values():
        if pid != children.get("agent"):
            assert f" pid {pid} on " in text


def test_a_profile_of_one_second_is_a_flame_graph_of_every_process(
    deployment: Deployment,
) -> None:
    status, svg = deployment.get("/admin/diagnostics/profile.svg", seconds=1, mode="wall")
    assert status == 200 and svg.startswith("<?xml")
    children = deployment.children()
    for name in ("web-1", "web-2", "worker", "beat"):
        assert f"{children[name]}" in svg
    assert deployment.diagnosed is not None
    _, cpu = deployment.get(
        "/admin/diagnostics/profile.svg", seconds=1, pid=deployment.diagnosed.proc.pid
    )
    assert "spin_in_a_known_function" in cpu


def test_heap_tracing_switched_on_in_every_process_shows_the_leak(
    deployment: Deployment,
) -> None:
    status, _, body = http(
        "POST", deployment.admin + "/admin/diagnostics/heap", key=deployment.token,
        body=b"action=start", headers={"Content-Type": "application/x-www-form-urlencoded"},
    )  # fmt: skip
    assert status == 200, body
    switched = answers_by_role(json.loads(body)["processes"])
    assert all(a["answer"]["tracing"] for answers in switched.values() for a in answers)
    assert len(switched["web"]) == 2
    assert deployment.diagnosed is not None
    pid = deployment.diagnosed.proc.pid

    def leak_grown() -> str | None:
        text = deployment.get("/admin/diagnostics/heap.txt", pid=pid)[1]
        return text if "the leaking line" in text else None

    wait_until(leak_grown, what="the leak in the heap's growth")
    status, _, body = http(
        "POST", deployment.admin + "/admin/diagnostics/heap", key=deployment.token,
        body=b"action=stop", headers={"Content-Type": "application/x-www-form-urlencoded"},
    )  # fmt: skip
    assert not any(a["answer"]["tracing"] for a in json.loads(body)["processes"])


def test_objects_gc_memory_lag_and_connections_of_every_process(deployment: Deployment) -> None:
    _, body = deployment.get("/admin/diagnostics/objects", top=10)
    for answer in body["processes"]:
        assert answer["answer"]["tracked"] > 0
        assert len(answer["answer"]["types"]) == 10
        assert len(answer["answer"]["gc"]["generations"]) == 3
    _, body = deployment.get("/admin/diagnostics/processes")
    roles = answers_by_role(body["processes"])
    for answers in roles.values():
        for answer in answers:
            info = answer["answer"]
            assert info["memory"]["rss_bytes"] > 10 * 2**20
            assert info["threads"]["python"] >= 2
    for web in roles["web"]:
        assert web["answer"]["loop_lag"]["interval_s"] == 0.5
        assert web["answer"]["loop_lag"]["window_s"] > 0
        store = {c["name"]: c for c in web["answer"]["connections"]}["store"]
        assert store["where"].endswith("run.sqlite3") and isinstance(store["open"], int)
        assert web["answer"]["store_pool"] is None  # SQLite: no pool
    assert all(a["answer"]["loop_lag"] is None for a in roles["worker"] + roles["beat"])


def test_the_client_port_never_serves_them_and_the_admin_port_asks_who_is_asking(
    deployment: Deployment,
) -> None:
    for path in ("/admin/diagnostics/", "/admin/diagnostics/stacks", "/admin/diagnostics"):
        status, _, _ = http("GET", deployment.client + path, key=deployment.token)
        assert status == 404
    status, _, body = http("GET", deployment.admin + "/admin/diagnostics/stacks")
    assert status == 401 and b"unauthorized" in body
    assert http("GET", deployment.admin + "/admin/diagnostics/profile.svg")[0] == 401
    # The page itself sends a browser to the admin's sign-in (followed here).
    status, _, page = http("GET", deployment.admin + "/admin/diagnostics/")
    assert status == 200 and 'name="next" value="/admin/diagnostics/"' in page.decode()


def test_manage_py_diagnose_prints_the_same_from_a_shell(
    deployment: Deployment, tmp_path: Path
) -> None:
    children = deployment.children()
    done = deployment.manage("diagnose")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[1]: line.split()[0] for line in done.stdout.splitlines()[1:] if line}
    for name in ("web-1", "web-2", "worker", "beat"):
        assert rows[str(children[name])] == name.split("-")[0]
    web = children["web-1"]
    stacks = deployment.manage("diagnose", "stacks", "--pid", str(web)).stdout
    assert stacks.startswith(f"=== web pid {web} on ") and "Thread MainThread" in stacks
    assert "Task Task-1 (Server.serve)" in stacks
    graph = tmp_path / "profile.svg"
    profile = deployment.manage("diagnose", "profile", "--seconds", "1", "--output", str(graph))
    assert profile.returncode == 0, profile.stderr
    assert "self ms" in profile.stdout and graph.read_text().startswith("<?xml")
    objects = deployment.manage("diagnose", "objects", "--pid", str(web), "--top", "5").stdout
    assert f"=== web pid {web}" in objects and "generation 2:" in objects
    heap = deployment.manage("diagnose", "heap", "--pid", str(web)).stdout
    assert "tracemalloc is off" in heap


def test_every_line_of_every_process_is_one_json_object(deployment: Deployment) -> None:
    """Last in the module: it stops the deployment, so that the stop's lines count too."""
    children = deployment.children()
    deployment.run.stop(timeout=60)
    lines = deployment.errors.read_text().splitlines()
    assert lines
    parsed = [json.loads(line) for line in lines]  # every line, or this fails naming it
    for line in parsed:
        assert set(line) >= LINE_FIELDS, line
        assert isinstance(line["pid"], int) and line["level"] in {
            "DEBUG",
            "INFO",
            "WARNING",
            "ERROR",
            "CRITICAL",
        }
    by_pid = {line["pid"]: line["process"] for line in parsed}
    assert by_pid[deployment.run.pid] == "run"
    for name, pid in children.items():
        assert by_pid.get(pid) == name.split("-")[0], f"{name} (pid {pid}) wrote no JSON line"
    agent = [line for line in parsed if line["process"] == "agent"]
    assert agent and all(line["node"] == "local" for line in agent)
