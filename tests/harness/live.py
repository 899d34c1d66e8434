"""Real processes for the gateway's end-to-end tests: ``sim`` engines and daphne web processes
on loopback, and the rows that route one to the other.

Nothing here is a stand-in: the engines are ``python -m agents.sim`` processes, the gateway is
``daphne llmgw_site.asgi:application`` on the test database, and clients are the official
``openai`` package or plain HTTP.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from control.models import Node, Profile, Replica, ServedModel, Shard
from gateway import keys
from gateway.models import ApiKey, UsageRecord
from tests.harness.procs import REPO_ROOT, free_port
from tests.harness.store import child_env
from tests.harness.waits import wait_until

PYTHON = sys.executable
_names = itertools.count(1)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class Proc:
    name: str
    port: int
    args: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Proc:
        handle = self.log.open("ab")
        self.process = subprocess.Popen(
            self.args, env=self.env, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT
        )
        handle.close()
        wait_until(self._alive_and_listening, timeout)
        return self

    def _alive_and_listening(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.process.returncode}:\n{self.output()}")
        return _port_open(self.port)

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        assert_no_secrets(self.name, self.output())
        return self.process.returncode

    def wait(self, timeout: float = 15.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_sim(tmp: Path, names: Iterable[str], *extra: str) -> Proc:
    port = free_port()
    names = list(names)
    args = [
        PYTHON,
        "-m",
        "agents.sim",
        "--port",
        str(port),
        "--model",
        names[0],
        "--served-model-name",
        *names,
        *extra,
    ]
    env = dict(os.environ)
    return Proc(f"sim:{port}", port, args, env, tmp / f"sim-{port}.log").start()


def start_web(tmp: Path, **settings: str) -> Proc:
    """One daphne web process on the test database, with short intervals for tests."""
    port = free_port()
    env = child_env(
        LLMGW_VAR_DIR=str(tmp / "var"),
        LLMGW_ROUTING_REFRESH="0.1",
        LLMGW_KEY_CACHE_TTL="0.3",
        LLMGW_USAGE_FLUSH_INTERVAL="0.05",
        LLMGW_LOG_LEVEL="INFO",
        **settings,
    )
    args = [
        PYTHON,
        "-m",
        "daphne",
        "-b",
        "127.0.0.1",
        "-p",
        str(port),
        "llmgw_site.asgi:application",
    ]
    return Proc(f"web:{port}", port, args, env, tmp / f"web-{port}.log").start()


# --- rows ----------------------------------------------------------------------------------


# Every key the tests issued, so that every process's log can be searched for them (G15).
ISSUED: list[str] = []


def make_key(username: str = "alice", **kwargs: Any) -> tuple[str, ApiKey]:
    user_model = get_user_model()
    if not user_model.objects.filter(username=username).exists():
        user_model.objects.create_user(username=username)
    issued = keys.issue(username, **kwargs)
    ISSUED.append(issued.key)
    return issued.key, issued.api_key


def assert_no_secrets(name: str, log: str) -> None:
    """G15: no key (whole, or its secret part), bearer header or Authorization value in a log."""
    leaked = [k[:14] + "…" for k in ISSUED if k in log or k[14:] in log]
    assert not leaked, f"{name} logged API keys: {leaked}"
    for marker in ("Bearer ", "Authorization:", "authorization:"):
        assert marker not in log, f"{name} logged {marker!r}"


@dataclass
class Served:
    model: ServedModel
    replicas: list[Replica] = field(default_factory=list)


def serve_model(
    name: str, ports: Iterable[int], *, ready: bool = True, **model_fields: Any
) -> Served:
    """A catalog model with one ready replica per port (each on its own healthy node)."""
    tag = next(_names)
    with transaction.atomic():
        profile = Profile.objects.create(name=f"p{tag}-{os.getpid()}")
        model = ServedModel.objects.create(
            name=name, source=name, default_profile=profile, **model_fields
        )
        served = Served(model)
        for port in ports:
            served.replicas.append(add_replica(model, profile, port, ready=ready))
    return served


def add_replica(model: ServedModel, profile: Profile, port: int, *, ready: bool = True) -> Replica:
    node = Node.objects.create(name=f"n{next(_names)}-{port}", addresses=["127.0.0.1"])
    Node.objects.filter(pk=node.pk).update(health=Node.Health.READY)
    replica = Replica.objects.create(model=model, profile=profile)
    if ready:
        Replica.objects.filter(pk=replica.pk).update(observed=Replica.Observed.READY)
    Shard.objects.create(replica=replica, node=node, port=port)
    return replica


def usage_rows(api_key: ApiKey) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(api_key=api_key).order_by("started_at"))


def wait_for_rows(api_key: ApiKey, count: int, timeout: float = 15.0) -> list[UsageRecord]:
    return wait_until(  # type: ignore[no-any-return]
        lambda: (rows := usage_rows(api_key)) and len(rows) >= count and rows, timeout
    )


def http(
    method: str,
    url: str,
    *,
    key: str | None = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> tuple[int, dict[str, str], bytes]:
    """A plain HTTP call (for what the openai client cannot send: wrong types, raw bytes)."""
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


_METRIC = re.compile(r"^([a-z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$")


def sim_metrics(sim: Proc) -> dict[str, float]:
    """A sim's Prometheus counters, summed over labels."""
    _, _, body = http("GET", sim.url + "/metrics")
    totals: dict[str, float] = {}
    for line in body.decode().splitlines():
        match = _METRIC.match(line)
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


def set_sim_faults(sim: Proc, times: int | None = None, **faults: Any) -> None:
    import json

    payload = dict(faults)
    if times is not None:
        payload["times"] = times
    status, _, body = http("POST", sim.url + "/sim/faults", body=json.dumps(payload).encode())
    assert status == 200, body


def close_db_thread() -> None:
    """Close the connection ``sync_to_async`` opened in its database thread, so the test
    database can be dropped at the end of the run (PostgreSQL refuses while one is open)."""
    from asgiref.sync import SyncToAsync
    from django.db import connections

    SyncToAsync.single_thread_executor.submit(connections.close_all).result()


def quiesce(timeout: float = 5.0) -> None:
    """Wait until the web processes stop adding usage rows (their writer runs every 0.05 s in
    these tests), so that pytest-django's flush after a test does not race with them:
    PostgreSQL resolves a TRUNCATE against an INSERT's foreign-key locks as a deadlock and may
    abort the flush."""
    deadline = time.monotonic() + timeout
    last, stable = -1, 0
    while time.monotonic() < deadline and stable < 3:
        count = UsageRecord.objects.count()
        stable = stable + 1 if count == last else 0
        last = count
        time.sleep(0.1)
