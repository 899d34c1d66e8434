"""The embedded default end to end: `manage.py run` (what `make run` starts) with its web
processes, reconciler worker and beat, and local agent with simulated GPUs, on the store under
test and no Redis. A user's path through it with the official `openai` client: the demo model
starts on the first request (scale from zero), answers, survives its engine crashing, and
Ctrl-C leaves nothing running. How long the cold start takes is measured by ``make bench``.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from control.models import Node, Profile, Replica
from tests.harness.procs import Proc, engine_processes, free_port, port_window
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]


@dataclass
class Running:
    proc: Proc
    ports: tuple[int, int]  # its engines'
    base_url: str
    api_key: str
    model: str


def start_make_run(var: Path, port: int, env: dict[str, str]) -> tuple[Proc, str]:
    """``manage.py run`` until it has printed its banner; the banner."""
    argv = [sys.executable, "manage.py", "run", "--port", str(port)]
    proc = Proc("make-run", argv, var / "logs", env, port=port).start()
    banner = wait_until(
        lambda: "Ctrl-C stops everything" in (text := proc.log()) and text,
        what="the banner",
        logs=[proc],
    )
    return proc, banner


def read_banner(banner: str) -> tuple[str, str, str]:
    """(base_url, API key, model) as a user reads them off the banner."""
    key = re.search(r"API key:\s+(\S+)", banner)
    base = re.search(r"OpenAI base_url for clients: (\S+)", banner)
    model = re.search(r'"model": "([^"]+)"', banner)
    assert key and base and model, banner
    return base.group(1), key.group(1), model.group(1)


@pytest.fixture
def llmgw(tmp_path: Path) -> Iterator[Running]:
    ports = port_window()
    env = child_env(
        LLMGW_VAR_DIR=str(tmp_path / "var"),
        LLMGW_WEB_PROCESSES="2",
        LLMGW_PORT_RANGE="{}-{}".format(*ports),
    )
    env.pop("REDIS_URL", None)
    proc, banner = start_make_run(tmp_path / "var", free_port(), env)
    try:
        yield Running(proc, ports, *read_banner(banner))
    finally:
        if proc.running():
            proc.signal(signal.SIGINT)
            proc.wait(120)


def stream_text(client: openai.OpenAI, model: str) -> str:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_make_run_serves_a_cold_model_survives_a_crash_and_stops_cleanly(llmgw: Running) -> None:
    # The engine takes a second to start, as a real one takes to load weights.
    profile = Profile.objects.get(models__name=llmgw.model)
    Profile.objects.filter(pk=profile.pk).update(args=[*profile.args, "--startup-delay", "1"])
    client = openai.OpenAI(
        base_url=llmgw.base_url, api_key=llmgw.api_key, max_retries=0, timeout=120
    )
    assert [m.id for m in client.models.list().data] == [llmgw.model]
    wait_until(
        lambda: Node.objects.filter(name="local", health="ready").exists(),
        what="the local agent",
        logs=[llmgw.proc],
    )

    # Scale from zero: the first request starts the model and gets its answer.
    assert stream_text(client, llmgw.model).startswith("tok1")
    (replica,) = Replica.objects.filter(model__name=llmgw.model, desired="running")
    assert replica.observed == "ready"
    assert stream_text(client, llmgw.model).startswith("tok1")  # warm now

    # The engine crashes: the replica fails, restarts after its backoff, and serves again.
    with pytest.raises(openai.APIError):
        client.chat.completions.create(
            model=llmgw.model,
            messages=[{"role": "user", "content": "crash"}],
            extra_body={"sim": {"crash": True}},
        )
    wait_until(
        lambda: Replica.objects.filter(pk=replica.pk, generation__gt=1).exists(),
        what="the crashed replica to restart",
        logs=[llmgw.proc],
    )
    again = client.chat.completions.create(
        model=llmgw.model, messages=[{"role": "user", "content": "still there?"}]
    )
    assert again.choices[0].message.content

    engines = [pid for pid, _ in engine_processes(llmgw.ports)]
    assert engines
    llmgw.proc.signal(signal.SIGINT)
    assert llmgw.proc.wait(120) == 0
    wait_until(
        lambda: not set(engines) & {pid for pid, _ in engine_processes(llmgw.ports)},
        what="the engines to stop with llmgw",
    )
