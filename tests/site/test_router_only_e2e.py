"""`manage.py run --router-only`: the gateway alone in front of engines llmgw does not run.

With one static endpoint (a real ``sim`` engine) it lists exactly that endpoint's models,
answers through it with the official ``openai`` client, and runs no reconciler, beat or agent
and adds no demo model; with nothing to serve it refuses to start, naming what is missing.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from control.models import ServedModel
from gateway.models import Endpoint
from tests.harness.live import start_sim
from tests.harness.procs import REPO_ROOT, Proc, free_port
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]


def descendants(pid: int) -> list[list[str]]:
    """The command lines of every process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[list[str]] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        found.append(argv.split("\0"))
        todo += children.get(child, [])
    return found


def test_router_only_serves_exactly_its_static_endpoint(tmp_path: Path) -> None:
    sim = start_sim(tmp_path / "logs", ["upstream-a", "upstream-alias"])
    port = free_port()
    env = child_env(
        LLMGW_VAR_DIR=str(tmp_path / "var"),
        LLMGW_WEB_PROCESSES="1",
        LLMGW_STATIC_ENDPOINTS=f"a=http://127.0.0.1:{sim.port}=upstream-a,upstream-alias",
    )
    env.pop("REDIS_URL", None)
    argv = [sys.executable, "manage.py", "run", "--router-only", "--port", str(port)]
    run = Proc("router-only", argv, tmp_path / "logs", env, port=port).start()
    try:
        banner = wait_until(
            lambda: "Ctrl-C stops everything" in (text := run.log()) and text,
            what="the banner",
            logs=[run],
        )
        key = re.search(r"API key:\s+(\S+)", banner)
        assert key is not None, banner
        run.wait_answering()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1), max_retries=0
        )
        assert sorted(m.id for m in client.models.list()) == ["upstream-a", "upstream-alias"]
        reply = client.chat.completions.create(
            model="upstream-a", messages=[{"role": "user", "content": "Hello"}]
        )
        assert reply.choices[0].message.content
        # No demo model in the catalog, and nothing but web processes under the launcher.
        assert not ServedModel.objects.exists()
        below = [" ".join(argv) for argv in descendants(run.pid)]
        assert below, "the launcher runs its web processes"
        assert not [a for a in below if "celery" in a or "-m agents" in a], below
    finally:
        run.signal(signal.SIGINT)
        run.wait(120)
        sim.stop()


def test_router_only_with_nothing_to_serve_refuses_to_start(tmp_path: Path) -> None:
    env = child_env(LLMGW_VAR_DIR=str(tmp_path / "var"), LLMGW_STATIC_ENDPOINTS="")
    argv = [sys.executable, "manage.py", "run", "--router-only", "--port", str(free_port())]
    done = subprocess.run(
        argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "--router-only has nothing to serve" in done.stderr
    assert "LLMGW_STATIC_ENDPOINTS" in done.stderr
    assert not ServedModel.objects.exists(), "no demo model was added"


def test_router_only_counts_an_enabled_endpoint_row_and_ignores_a_disabled_one() -> None:
    from llmgw_site.management.commands.run import router_only_models

    Endpoint.objects.create(
        slug="off", url="http://10.0.0.9:8000", model_names=["x"], enabled=False
    )
    assert router_only_models() == []
    Endpoint.objects.create(slug="on", url="http://10.0.0.5:8000", model_names=["m2", "m1"])
    assert router_only_models() == ["m1", "m2"]
