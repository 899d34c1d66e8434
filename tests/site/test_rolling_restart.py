"""``manage.py run`` under live traffic, as an operator runs it: listeners split by role, a
rolling restart (SIGHUP) and the stop of one web process of two, each with 200 streams and a
steady request rate from the official ``openai`` client in flight (S4-S6 in
docs/scenarios.md). One ``manage.py run`` for the module; the engine is a live ``sim`` named
in ``LLMGW_STATIC_ENDPOINTS``."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.harness.live import start_sim
from tests.harness.procs import Proc, alive, free_port, port_open
from tests.harness.store import process_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e]

MODEL = "steady"
STREAMS = 200
TOKENS = 30
ITL_MS = 200  # each stream lasts about 6 s: long enough to span a restart


@dataclass
class Run:
    proc: Proc
    port: int
    admin_port: int
    metrics_port: int
    key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def web_pids(self) -> set[int]:
        children = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        return {int(pid) for pid in children if b"llmgw_site.webserver" in cmdline(int(pid))}


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("rolling")
    sim = start_sim(tmp / "engines", [MODEL])
    port, admin_port, metrics_port = free_port(), free_port(), free_port()
    env = process_env(
        LLMGW_VAR_DIR=str(tmp),
        LLMGW_WEB_PROCESSES="2",
        LLMGW_STATIC_ENDPOINTS=f"e1=http://127.0.0.1:{sim.port}={MODEL}",
        LLMGW_SHUTDOWN_GRACE="30",
        # The slow-client deadline is not this test's subject (G8's is). Its one client drives
        # 200 streams and the steady requests from one event loop; in a full CI run on a
        # loaded 2-core machine, requests failed with a read error some 15 s after being sent,
        # while the servers counted connections closed for headers that had not come within
        # the 10 s default (`llmgw_slow_clients_closed{phase="headers"}`: 2 and 3 in the two
        # tests). With a longer deadline a request the servers lose still fails here: the
        # client gives up after 120 s.
        LLMGW_HEADER_TIMEOUT="90",
        DATABASE_URL=f"sqlite:///{tmp / 'run.sqlite3'}",
    )
    command = [
        sys.executable, "manage.py", "run", "--no-agent", "--port", str(port),
        "--admin-listen", str(admin_port), "--metrics-listen", f"127.0.0.1:{metrics_port}",
    ]  # fmt: skip
    proc = Proc("run", command, tmp / "logs", env, port=port).start()
    try:
        found = wait_until(
            lambda: re.search(r"API key:\s+(\S+)", proc.log()), what="the banner", logs=[proc]
        )
        live = Run(proc, port, admin_port, metrics_port, found.group(1))
        wait_until(lambda: len(live.web_pids()) == 2 and port_open(port), what="2 web processes")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0)
        wait_until(lambda: MODEL in [m.id for m in client.models.list().data], what="routed")
        yield live
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(120)
        sim.stop()


@dataclass
class Traffic:
    """What the clients saw: finished streams, their errors, and the steady requests."""

    streams_done: int = 0
    stream_errors: list[str] = field(default_factory=list)
    short_events: int = 0
    requests_sent: int = 0
    requests_during: int = 0  # sent between the action and its outcome (then())
    requests_ok: int = 0
    request_errors: list[str] = field(default_factory=list)


async def traffic_across(
    run: Run, action: Callable[[], Any], *, then: Callable[[], bool]
) -> Traffic:
    """200 streams and ~10 requests a second; ``action`` once every stream is under way, and
    the steady rate goes on until ``then()`` holds and every stream is done."""
    seen = Traffic()
    client = openai.AsyncOpenAI(
        base_url=run.url + "/v1", api_key=run.key, max_retries=0, timeout=120
    )

    async def one_stream() -> None:
        events = 0
        try:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "go"}],
                max_tokens=TOKENS,
                stream=True,
                extra_body={"sim": {"itl_ms": ITL_MS, "ttft_ms": 5}},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    events += 1
        except Exception as error:  # every kind counts: the client saw it
            seen.stream_errors.append(repr(error))
            return
        seen.streams_done += 1
        if events != TOKENS:
            seen.short_events += 1

    async def one_request() -> None:
        seen.requests_sent += 1
        sent = loop.time()
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            seen.requests_ok += 1
        except Exception as error:
            # When, from the action, it was sent and failed: to tell a race at the change from
            # one at its end.
            since = f"sent {sent - acted:+.2f}s, failed {loop.time() - acted:+.2f}s from the action"
            seen.request_errors.append(f"{error!r} caused by {error.__cause__!r}, {since}")

    loop = asyncio.get_running_loop()
    streams = [asyncio.create_task(one_stream()) for _ in range(STREAMS)]
    requests: list[asyncio.Task[None]] = []
    await asyncio.sleep(1.5)  # every stream connected and under way
    acted = loop.time()
    await asyncio.to_thread(action)
    deadline = loop.time() + 90
    while loop.time() < deadline and not (all(s.done() for s in streams) and then()):
        requests.append(asyncio.create_task(one_request()))
        seen.requests_during += 1
        await asyncio.sleep(0.1)
    for _ in range(20):  # a last second of requests on whatever serves now
        requests.append(asyncio.create_task(one_request()))
        await asyncio.sleep(0.05)
    await asyncio.gather(*streams, *requests)
    await client.close()
    return seen


def assert_clean(seen: Traffic, run: Run) -> None:
    # What the servers said and counted, for a failure to explain itself.
    scraped = httpx.get(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=60).text
    deadlines = [s for s in scraped.splitlines() if s.startswith("llmgw_slow_clients_closed")]
    said = f"\n--- run's log ---\n{run.proc.tail(40)}\n--- closed by deadline ---\n"
    said += "\n".join(deadlines)
    assert seen.stream_errors == [], f"{seen.stream_errors[:5]}{said}"
    assert seen.request_errors == [], f"{seen.request_errors[:5]}{said}"
    assert seen.streams_done == STREAMS and seen.short_events == 0
    # Every request answered, some of them sent while the change was under way (how many
    # depends on how fast a loaded machine makes the change, so no count is asked for).
    assert seen.requests_ok == seen.requests_sent
    assert seen.requests_during >= 1


def test_listeners_split_by_role(run: Run) -> None:
    # A web process imports the admin on its first admin page (most of a second on a slow
    # machine, several under the suite's load): more than httpx's 5 s default may pass.
    get = functools.partial(httpx.get, timeout=60)
    client_port = run.url
    admin = f"http://127.0.0.1:{run.admin_port}"
    metrics = f"http://127.0.0.1:{run.metrics_port}"
    assert get(client_port + "/admin/login/").status_code == 404
    assert get(client_port + "/account/").status_code == 404
    assert get(client_port + "/metrics").status_code == 404
    assert get(client_port + "/healthz").status_code == 200
    assert get(admin + "/admin/login/").status_code == 200
    assert (
        get(admin + "/v1/models", headers={"Authorization": f"Bearer {run.key}"}).status_code == 404
    )
    assert get(metrics + "/admin/login/").status_code == 404
    assert get(metrics + "/v1/models").status_code == 404
    scraped = get(metrics + "/metrics")
    assert scraped.status_code == 200
    assert "llmgw_" in scraped.text
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=scraped.content, capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stderr.decode() + checked.stdout.decode()


def test_sighup_replaces_web_processes_with_no_client_visible_error(run: Run) -> None:
    before = run.web_pids()
    assert len(before) == 2

    def replaced() -> bool:
        now = run.web_pids()
        return len(now) == 2 and not (now & before) and not any(alive(p) for p in before)

    seen = asyncio.run(traffic_across(run, lambda: run.proc.signal(signal.SIGHUP), then=replaced))
    assert replaced(), "the web processes were not replaced"
    assert_clean(seen, run)


def test_sigterm_of_one_web_process_of_two_loses_nothing(run: Run) -> None:
    before = run.web_pids()
    victim = min(before)

    def victim_gone() -> bool:
        return not alive(victim)

    seen = asyncio.run(
        traffic_across(run, lambda: os.kill(victim, signal.SIGTERM), then=victim_gone)
    )
    assert victim_gone()
    assert_clean(seen, run)
