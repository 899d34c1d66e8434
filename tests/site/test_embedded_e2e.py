"""The embedded default end to end: `manage.py run` (what `make run` starts) with its web
processes, reconciler worker and beat, and local agent with simulated GPUs, on the store under
test and no Redis. A user's path through it with the official `openai` client: the demo model
starts on the first request (scale from zero), answers, survives its engine crashing, and
Ctrl-C leaves nothing running.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from control.models import Profile, Replica
from tests.harness.cluster import engine_processes
from tests.harness.procs import REPO_ROOT, free_port
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]

STARTUP_DELAY = 1.0


@dataclass
class Running:
    process: subprocess.Popen[str]
    log: Path
    base_url: str
    api_key: str
    model: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def llmgw(tmp_path: Path) -> Iterator[Running]:
    port = free_port()
    env = child_env(
        LLMGW_VAR_DIR=str(tmp_path / "var"),
        LLMGW_WEB_PROCESSES="2",
        LLMGW_PORT_RANGE="23800-23849",
    )
    env.pop("REDIS_URL", None)
    log = tmp_path / "run.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "run", "--port", str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        text = wait_until(
            lambda: "Ctrl-C stops everything" in (t := log.read_text()) and t, 60, "the banner"
        )
        key = re.search(r"API key:\s+(\S+)", text)
        base = re.search(r"OpenAI base_url for clients: (\S+)", text)
        model = re.search(r'"model": "([^"]+)"', text)
        assert key and base and model, text
        yield Running(process, log, base.group(1), key.group(1), model.group(1))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(60)


def first_token_time(client: openai.OpenAI, model: str, **extra: Any) -> tuple[float, str]:
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], stream=True, **extra
    )
    first = None
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic() - started
            text += chunk.choices[0].delta.content
    assert first is not None
    return first, text


def test_make_run_serves_a_cold_model_survives_a_crash_and_stops_cleanly(
    llmgw: Running, capsys: Any
) -> None:
    # The engine takes STARTUP_DELAY to start, as a real one takes to load weights.
    profile = Profile.objects.get(models__name=llmgw.model)
    Profile.objects.filter(pk=profile.pk).update(
        args=[*profile.args, "--startup-delay", str(STARTUP_DELAY)]
    )
    client = openai.OpenAI(base_url=llmgw.base_url, api_key=llmgw.api_key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [llmgw.model]
    wait_until(lambda: "node local connected" in llmgw.output(), 60, "the local agent")

    cold, text = first_token_time(client, llmgw.model)
    assert text.startswith("tok1")
    # Each web process sees the new replica within one routing refresh; after that, warm.
    time.sleep(1.5)
    warm = min(first_token_time(client, llmgw.model)[0] for _ in range(3))
    with capsys.disabled():
        print(f"\n[make run] cold first token {cold:.2f}s, warm {warm * 1000:.0f} ms")
    assert warm < 0.5

    # The engine crashes: the replica fails, restarts after its backoff, and serves again.
    (replica,) = Replica.objects.filter(model__name=llmgw.model, desired="running")
    with pytest.raises(openai.APIError):
        client.chat.completions.create(
            model=llmgw.model,
            messages=[{"role": "user", "content": "crash"}],
            extra_body={"sim": {"crash": True}},
        )
    wait_until(
        lambda: Replica.objects.filter(pk=replica.pk, generation__gt=1).exists(),
        60,
        "the crashed replica to restart",
    )
    again = client.chat.completions.create(
        model=llmgw.model, messages=[{"role": "user", "content": "still there?"}]
    )
    assert again.choices[0].message.content

    engines = [pid for pid, env in engine_processes() if env.get("LLMGW_SHARD_ID")]
    assert engines
    llmgw.process.send_signal(signal.SIGINT)
    assert llmgw.process.wait(60) == 0
    wait_until(
        lambda: not set(engines) & {pid for pid, _ in engine_processes()},
        20,
        "the engines to stop with llmgw",
    )
    with capsys.disabled():
        print(
            f"\n[make run] cold start: first token after {cold:.2f}s with a "
            f"{STARTUP_DELAY:g}s engine start-up: overhead {cold - STARTUP_DELAY:.2f}s; "
            f"warm first token {warm * 1000:.0f} ms"
        )
