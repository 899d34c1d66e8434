"""/healthz, `manage.py lease`, `manage.py run`, and the Django-free agents package."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command

from control import leases
from tests.harness.asgi import call_http
from tests.harness.live import start_sim
from tests.harness.procs import REPO_ROOT, Proc, alive, free_port, port_open, port_window
from tests.harness.store import process_env
from tests.harness.waits import wait_until


async def healthz() -> tuple[int, Any]:
    """``/healthz`` through the web process's application, the one place that answers it."""
    from llmgw_site.asgi import application

    status, body = await call_http(application, "/healthz")
    return status, json.loads(body)


@pytest.mark.django_db
async def test_healthz_reports_version_and_a_reachable_store() -> None:
    status, body = await healthz()
    assert status == 200
    assert body == {"status": "ok", "version": "0.1.0", "database": "reachable"}


@pytest.mark.django_db
def test_healthz_answers_503_when_the_store_is_unreachable(store_unreachable: None) -> None:
    # From this thread, as the store is made unreachable for this thread's connection.
    status, body = async_to_sync(healthz)()
    assert status == 503
    assert body["database"] == "unreachable"


def run_lease_command() -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("lease", stdout=out, stderr=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    return 0, out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_lease_command_shows_holder_epoch_and_exit_status(election_on: Any) -> None:
    assert run_lease_command() == (0, "lease reconciler: never claimed; this process could lead\n")
    leases.claim(owner="other-host:1:abc", ttl=30)
    code, text = run_lease_command()
    assert code == 1
    assert "held by other-host:1:abc, epoch 1," in text
    assert "s left" in text
    leases.claim(owner="other-host:1:abc", ttl=0)
    code, text = run_lease_command()
    assert code == 0 and "expired" in text and "could lead" in text


@pytest.mark.django_db(transaction=True)
def test_lease_command_exits_2_when_the_store_is_unreachable(
    election_on: Any, store_unreachable: None
) -> None:
    code, text = run_lease_command()
    assert code == 2 and "store unreachable" in text


def test_agents_package_imports_without_django() -> None:
    code = (
        "import sys, pkgutil, importlib, agents\n"
        "for m in pkgutil.walk_packages(agents.__path__, 'agents.'):\n"
        "    if m.name.endswith('__main__'): continue\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'django' or n.startswith('django.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_run_starts_every_process_on_one_port_and_stops_them_all(tmp_path: Any) -> None:
    """`manage.py run` on a fresh embedded store: migrates, prints an admin password once,
    serves /healthz from two web processes on one port beside the worker, beat and local
    agent, and Ctrl-C leaves nothing running."""
    port = free_port()
    env = process_env(
        LLMGW_VAR_DIR=str(tmp_path),
        LLMGW_WEB_PROCESSES="2",
        LLMGW_PORT_RANGE="{}-{}".format(*port_window()),
    )
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'run.sqlite3'}"
    command = [sys.executable, "manage.py", "run", "--port", str(port)]
    first = Proc("run", command, tmp_path / "logs", env, port=port).start()
    try:

        def healthy() -> Any:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
            except httpx.TransportError:
                return None
            return response.status_code == 200 and response.json()

        assert wait_until(healthy, what="/healthz", logs=[first])["database"] == "reachable"
        children = subprocess.run(
            ["pgrep", "-P", str(first.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        pids = {int(pid) for pid in children}
        assert len(pids) == 5, children  # 2 web, worker, beat, agent
    finally:
        first.signal(signal.SIGINT)
        code = first.wait(120)
    output = first.log()
    assert code == 0, output
    assert f"OpenAI base_url for clients: http://127.0.0.1:{port}/v1" in output
    assert "admin user:    admin / " in output
    for pid in pids:
        assert not alive(pid), f"process {pid} still running"

    second = Proc("run", command, tmp_path / "logs", env, port=port).start()
    try:
        wait_until(lambda: "Ctrl-C" in second.log(), what="the banner again", logs=[second])
    finally:
        second.signal(signal.SIGINT)
        second.wait(120)
    assert "admin user:    admin (its password was shown when it was created)" in second.log()


def test_stopping_run_refuses_new_connections_at_once_and_finishes_the_streams_in_flight(
    tmp_path: Any,
) -> None:
    """SIGTERM to `manage.py run` (a deploy's stop): the client port refuses new connections
    while the streams already in flight go on, so a balancer moves away at once; then every
    one of those streams ends whole and run exits 0."""
    sim = start_sim(tmp_path / "engines", ["steady"])
    port = free_port()
    env = process_env(
        LLMGW_VAR_DIR=str(tmp_path / "var"),
        LLMGW_WEB_PROCESSES="2",
        LLMGW_STATIC_ENDPOINTS=f"e1=http://127.0.0.1:{sim.port}=steady",
        LLMGW_SHUTDOWN_GRACE="60",
    )
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'run.sqlite3'}"
    env.pop("REDIS_URL", None)
    argv = [sys.executable, "manage.py", "run", "--no-agent", "--port", str(port)]
    run = Proc("run", argv, tmp_path / "logs", env, port=port).start()
    try:
        found = wait_until(
            lambda: port_open(port) and re.search(r"API key:\s+(\S+)", run.log()),
            what="run serving",
            logs=[run],
        )
        key = found.group(1)
        client = openai.OpenAI(base_url=f"{run.url}/v1", api_key=key, max_retries=0)
        wait_until(lambda: "steady" in [m.id for m in client.models.list().data], what="routed")
        streams = openai.AsyncOpenAI(base_url=f"{run.url}/v1", api_key=key, max_retries=0)

        async def one() -> int:
            stream = await streams.chat.completions.create(
                model="steady",
                messages=[{"role": "user", "content": "go"}],
                max_tokens=40,
                stream=True,
                extra_body={"sim": {"itl_ms": 250, "ttft_ms": 5}},
            )
            return sum([1 async for c in stream if c.choices and c.choices[0].delta.content])

        async def scenario() -> tuple[list[int], int]:
            tasks = [asyncio.create_task(one()) for _ in range(4)]
            await asyncio.sleep(1.0)  # every stream under way (each lasts about 10 s)
            run.signal(signal.SIGTERM)
            while await asyncio.to_thread(port_open, port) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            in_flight = sum(not t.done() for t in tasks)
            return list(await asyncio.gather(*tasks)), in_flight

        events, in_flight = asyncio.run(scenario())
        assert in_flight > 0, "refusal came only once every stream had ended"
        assert events == [40] * 4
        assert run.wait(120) == 0, run.tail()
    finally:
        run.stop(120)
        sim.stop()
