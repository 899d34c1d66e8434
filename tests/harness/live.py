"""A live gateway: ``sim`` engines and llmgw web processes on loopback, and the ways a test
talks to them (plain HTTP, the engines' own metrics and fault switches).

Nothing here is a stand-in: the engines are ``python -m agents.sim`` processes, the gateway is
the web process ``manage.py run`` starts, on the test database, and clients are the official
``openai`` package or plain HTTP.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

from gateway import dbthread
from gateway.ledger.usage import read_journal
from gateway.models import ApiKey, UsageRecord
from tests.harness.factories import ISSUED, usage_rows
from tests.harness.procs import PYTHON, Proc, free_port, web_process
from tests.harness.store import child_env
from tests.harness.waits import wait_until

# Short intervals, so that what a test waits for happens in a fraction of a second.
WEB_SETTINGS = {
    "LLMGW_ROUTING_REFRESH": "0.1",
    "LLMGW_KEY_CACHE_TTL": "0.3",
    "LLMGW_USAGE_FLUSH_INTERVAL": "0.05",
    "LLMGW_LOG_LEVEL": "INFO",
    # A stop does not wait out the test's own idle client connections for 10 s; the rolling
    # restart test keeps the default, which is what spares clients an error there.
    "LLMGW_IDLE_LINGER": "0.5",
}


def start_sim(log_dir: Path, names: Iterable[str], *extra: str) -> Proc:
    """A ``sim`` engine serving ``names`` (the first is its model)."""
    port = free_port()
    names = list(names)
    argv = [
        PYTHON, "-m", "agents.sim", "--port", str(port),
        "--model", names[0], "--served-model-name", *names, *extra,
    ]  # fmt: skip
    return Proc(f"sim-{port}", argv, log_dir, port=port).start().wait_listening()


def start_web(var_dir: Path, **settings: str) -> Proc:
    """One llmgw web process on the test database, its journals and files under ``var_dir``."""
    env = child_env(LLMGW_VAR_DIR=str(var_dir), **{**WEB_SETTINGS, **settings})
    return web_process("web", var_dir / "logs", env)


def assert_no_secrets(proc: Proc) -> None:
    """G15: no key (whole, or its secret part), bearer header or Authorization value logged."""
    log = proc.log()
    leaked = [k[:14] + "…" for k in ISSUED if k in log or k[14:] in log]
    assert not leaked, f"{proc.name} logged API keys: {leaked}"
    for marker in ("Bearer ", "Authorization:", "authorization:"):
        assert marker not in log, f"{proc.name} logged {marker!r}"


def stop_checked(*procs: Proc) -> None:
    """Stop web processes, then check that none of them logged a secret."""
    for proc in procs:
        proc.stop()
    for proc in procs:
        assert_no_secrets(proc)


def http(
    method: str,
    url: str,
    *,
    key: str | None = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, Message, bytes]:
    """A plain HTTP call (for what the openai client cannot send: wrong types, raw bytes).
    Header names are looked up case-insensitively, as HTTP means them (servers differ)."""
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def routes(web: Proc, key: str, model: str) -> bool:
    """The web process lists ``model`` to this key (its routing table has it)."""
    status, _, body = http("GET", web.url + "/v1/models", key=key)
    return status == 200 and model in [m["id"] for m in json.loads(body)["data"]]


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


def engine_requests(sim: Proc, *, running: bool = False) -> float:
    """Requests that reached the engine: finished, cancelled (client gone) or failed; with
    ``running``, those still in execution too, from the same scrape (read from two scrapes, a
    request ending in between was counted twice)."""
    metrics = sim_metrics(sim)
    return (
        metrics.get("vllm:request_success_total", 0)
        + metrics.get("sim:request_cancelled_total", 0)
        + metrics.get("sim:request_failed_total", 0)
        + (metrics.get("vllm:num_requests_running", 0) if running else 0)
    )


def set_sim_faults(sim: Proc, times: int | None = None, **faults: Any) -> None:
    payload = dict(faults)
    if times is not None:
        payload["times"] = times
    status, _, body = http("POST", sim.url + "/sim/faults", body=json.dumps(payload).encode())
    assert status == 200, body


def wait_for_rows(api_key: ApiKey, count: int, timeout: float = 60.0) -> list[UsageRecord]:
    """Until the key has at least ``count`` usage rows; the rows."""
    return wait_until(
        lambda: (rows := usage_rows(api_key)) and len(rows) >= count and rows,
        timeout,
        f"{count} usage row(s)",
    )


def journaled(var_dir: Path) -> set[str] | None:
    """Request ids in the usage journals of the web processes under ``var_dir`` (None while
    a journal is being rotated away under our feet: look again)."""
    ids: set[str] = set()
    for path in (var_dir / "usage").glob("*.journal"):
        try:
            ids.update(u.request_id for u in read_journal(path))
        except OSError:
            return None
    return ids


def close_db_thread() -> None:
    """Close the connections ``sync_to_async`` and the gateway's store lanes opened in their
    threads, so the test database can be dropped at the end of the run (PostgreSQL refuses
    while one is open), and forget any outage the lanes saw."""
    from asgiref.sync import SyncToAsync
    from django.db import connections

    SyncToAsync.single_thread_executor.submit(connections.close_all).result()
    dbthread.close()
    dbthread.outage.answered()


@dataclass
class Stack:
    """llmgw's web process in front of ``sim`` engines, for a module's tests."""

    web: Proc
    engines: list[Proc]
    var: Path
    before: set[str] = field(default_factory=set)

    def begin(self) -> None:
        """Remember the requests journaled so far (earlier tests'), for :meth:`settle`."""
        ids = None
        while ids is None:  # None only while a journal is rotated away: a moment
            ids = journaled(self.var)
        self.before = ids

    def settle(self) -> None:
        """Until every request since :meth:`begin` has its usage row (a request still in
        flight has none yet): nothing writes to the store after this, so the next test's
        fresh database is not raced by a late row."""

        missing: set[str] = set()

        def stored() -> bool:
            ids = journaled(self.var)
            if ids is None:
                return False
            wanted = ids - self.before
            missing.clear()
            missing.update(
                wanted
                - set(
                    UsageRecord.objects.filter(request_id__in=wanted).values_list(
                        "request_id", flat=True
                    )
                )
            )
            return not missing

        try:
            wait_until(stored, what="every request's usage row stored", logs=[self.web])
        except AssertionError as failure:
            raise AssertionError(f"{failure}\nnot stored: {sorted(missing)}") from None


@contextmanager
def gateway_stack(
    tmp: Path,
    models: Iterable[str],
    *,
    engines: int = 2,
    settings: Callable[[list[Proc]], dict[str, str]] = lambda engines: {},
) -> Iterator[Stack]:
    """``engines`` sims serving ``models`` and one web process (``settings`` may name the
    engines); on the way out, the web process's log is checked for secrets (G15)."""
    started: list[Proc] = []
    try:
        sims = [start_sim(tmp / "engines", models) for _ in range(engines)]
        started += sims
        web = start_web(tmp / "var", **settings(sims))
        started.append(web)
        yield Stack(web, sims, tmp / "var")
    finally:
        for proc in reversed(started):
            proc.stop()
        if len(started) > engines:
            assert_no_secrets(started[-1])
