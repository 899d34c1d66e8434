"""``/v1`` through its one front door (``gateway.edge.asgi``) and the web process's whole
application (``llmgw_site.asgi``): the relay routes never reach ninja, the model list answers as
ninja's operation does; and what a web process imports only on first use."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from control.views import health
from gateway.ledger.recorder import recorder
from gateway.relay.routes import RELAY_ROUTES
from gateway.routing.upstreams import upstreams
from tests.harness.asgi import call_http
from tests.harness.factories import make_key, serve_model
from tests.harness.live import close_db_thread

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _isolated(settings: Any, tmp_path: Path) -> Iterator[None]:
    # This process's own usage journal goes to the test's folder and is closed (rows stored)
    # before the test database goes away.
    settings.LLMGW_USAGE_JOURNAL_DIR = tmp_path
    yield
    recorder.close()
    close_db_thread()


async def test_the_relay_routes_are_answered_by_the_front_door_alone() -> None:
    """The relay routes have one front door (``gateway.edge.asgi``): ninja only documents them,
    so nothing of theirs reaches its handler."""
    key, _ = await sync_to_async(make_key)()
    await upstreams.refresh()
    body = json.dumps({"model": "nothing-here", "messages": []}).encode()
    status, missing = await call_v1("/v1/chat/completions", "POST", key, body=body)
    assert status == 404
    assert json.loads(missing)["error"]["code"] == "model_not_found"
    status, anonymous = await call_v1("/v1/embeddings", "POST", body=body)
    assert status == 401
    assert json.loads(anonymous)["error"]["code"] == "invalid_api_key"
    status, wrong_type = await call_v1(
        "/v1/completions", "POST", key, body=json.dumps({"model": 3}).encode()
    )
    assert status == 400
    assert json.loads(wrong_type)["error"]["param"] == "model"
    for route in RELAY_ROUTES:
        status, refused = await call_v1(route.path, "POST", body=body)
        assert status == 401 and json.loads(refused)["error"]["code"] == "invalid_api_key"
    status, listing = await call_site("/v1/models", key=key)
    assert status == 200 and json.loads(listing)["object"] == "list"


async def call_v1(
    path: str, method: str = "GET", key: str | None = None, *, body: bytes = b""
) -> tuple[int, bytes]:
    """One request through ``gateway.edge.asgi``'s application, failing if the application hands it
    to Django's handler."""
    from gateway.edge.asgi import V1App

    async def not_through_django(*args: Any) -> None:
        raise AssertionError(f"{method} {path} went to Django's handler (ninja)")

    app = V1App()
    app._django.respond = not_through_django  # type: ignore[method-assign,assignment]
    return await call_http(app, path, method, key, body=body)


async def call_ninja(path: str, key: str | None = None) -> tuple[int, bytes]:
    """One GET through ``/v1``'s ninja operations, on the handler ``gateway.edge.asgi`` hands
    every path it does not answer itself."""
    from gateway.edge.asgi import V1App

    app = V1App()

    async def ninja(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await app._django.respond(scope, b"", send)

    return await call_http(ninja, path, "GET", key)


async def call_site(path: str, key: str | None = None) -> tuple[int, bytes]:
    """One GET through the web process's whole application (``llmgw_site.asgi``)."""
    from llmgw_site.asgi import application

    return await call_http(application, path, "GET", key)


async def test_healthz_is_answered_before_django_and_only_there() -> None:
    status, body = await call_site("/healthz")
    assert status == 200
    assert json.loads(body) == (await health())[1]
    assert json.loads(body)["database"] == "reachable"
    # The site's URLconf has no /healthz of its own: the answer above is the one answer.
    assert (await AsyncClient().get("/healthz")).status_code == 404


async def test_a_module_loaded_on_first_use_is_imported_once_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a URLconf's first import costs is not spent on the event loop, where every request
    in flight would wait for it, and concurrent first requests import it once."""
    from gateway.edge.asgi import imported

    (tmp_path / "slow_urls.py").write_text(
        "import threading, time\nIMPORTS.append(threading.get_ident())\ntime.sleep(0.2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    imports: list[int] = []
    monkeypatch.setattr("builtins.IMPORTS", imports, raising=False)
    monkeypatch.delitem(sys.modules, "slow_urls", raising=False)
    await asyncio.gather(*(imported("slow_urls") for _ in range(5)))
    await imported("slow_urls")
    assert len(imports) == 1 and imports[0] != threading.get_ident()
    assert "slow_urls" in sys.modules


async def test_the_model_list_is_answered_without_ninja_as_ninja_answers_it() -> None:
    key, _ = await sync_to_async(make_key)()
    narrow, _ = await sync_to_async(make_key)(models=["chat-b"])
    await sync_to_async(serve_model)("chat-a", [9])
    await sync_to_async(serve_model)("chat-b", [9])
    await upstreams.refresh()
    for each in (key, narrow):
        status, body = await call_v1("/v1/models", key=each)
        ninja_status, ninja_body = await call_ninja("/v1/models", key=each)
        assert status == ninja_status == 200
        assert json.loads(body) == json.loads(ninja_body)
    assert [m["id"] for m in json.loads(body)["data"]] == ["chat-b"]
    for bad in (None, key + "x", "not-a-key"):
        status, body = await call_v1("/v1/models", key=bad)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


async def test_startup_loads_the_routing_table_without_waiting_for_it_or_a_request() -> None:
    """A web process's first ``/v1`` request began the routing table's first load and waited
    for it, with the store's connections (17-27 ms to its first token, 3.5 ms for the next
    ones): startup begins that now, and the process does not wait for it to serve."""
    from llmgw_site.asgi import application

    # A model no earlier load in this process can have seen.
    await sync_to_async(serve_model)("served-before-startup", [9])
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[str] = []

    async def send(message: Any) -> None:
        sent.append(message["type"])

    inbox.put_nowait({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(application({"type": "lifespan"}, inbox.get, send))
    async with asyncio.timeout(30):
        while upstreams.table.resolve("served-before-startup") is None:
            await asyncio.sleep(0.01)
    assert sent == ["lifespan.startup.complete"]
    inbox.put_nowait({"type": "lifespan.shutdown"})
    await lifespan
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_what_startup_prepares_for_v1_never_stops_the_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that does not answer at startup is what the first request would have found:
    nothing to report twice (the table's load says so, and keeps trying). Anything else is
    logged, and the process serves all the same."""
    from django.db import OperationalError

    from gateway.edge.asgi import prepare
    from gateway.identity import keys

    async def store_down() -> None:
        raise OperationalError("connection refused")

    async def broken() -> None:
        raise RuntimeError("a bug")

    await upstreams.refresh()
    monkeypatch.setattr(keys.cache, "prepare", store_down)
    await prepare()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    monkeypatch.setattr(keys.cache, "prepare", broken)
    await prepare()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "preparing /v1 failed"
    ]


def fresh_python(script: str) -> str:
    """What ``script`` prints, run in an interpreter that has imported nothing yet."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_web_process_serving_v1_and_healthz_imports_neither_ninja_celery_nor_the_admin() -> None:
    """Together nearly half of a web process's start: ninja is for the OpenAPI document and key
    usage, Celery for an early reconcile tick, the admin for its pages: each imported on first
    use."""
    script = """
import asyncio, sys
import llmgw_site.asgi
from tests.gateway.test_gateway_api import call_site, call_v1
assert asyncio.run(call_v1("/v1/models"))[0] == 401
assert asyncio.run(call_v1("/v1/chat/completions", "POST"))[0] == 401
assert asyncio.run(call_site("/healthz"))[0] in (200, 503)  # 503: no store in this process
loaded = ("ninja", "pydantic", "celery", "kombu", "llmgw_site.urls", "gateway.admin")
print(sorted(m for m in loaded if m in sys.modules))
"""
    assert fresh_python(script) == "[]"


def test_what_a_web_process_loads_on_first_use_is_kept_out_of_full_collections() -> None:
    """The process freezes what it loaded at start (``gateway.routing.upstreams``); the admin, ninja
    and Celery come later, on first use, and are frozen then: unfrozen, they made every full
    collection scan some 60,000 objects, a stall for each request in flight."""
    script = """
import asyncio, gc
import llmgw_site.asgi
from gateway.edge.asgi import imported
gc.freeze()  # as the process does once it is ready
import llmgw_site.celery  # as the first early reconcile tick does
print(len(gc.get_objects()))
asyncio.run(imported("gateway.edge.v1_urls"))  # as the first request that needs each does
asyncio.run(imported("llmgw_site.urls"))
print(len(gc.get_objects()))
"""
    after_celery, after_urlconfs = map(int, fresh_python(script).split())
    assert after_celery < 1_000 and after_urlconfs < 1_000


async def test_what_follows_a_whole_answer_runs_once_it_is_written_or_could_not_be() -> None:
    """The usage record of a non-streamed answer is made after the answer goes out (the client
    does not wait for it), and still made when the write fails or is cancelled (a client gone:
    the engine's tokens were spent all the same)."""
    import asyncio

    from gateway import responses
    from gateway.edge.asgi import send_answer

    events: list[str] = []

    def answer() -> responses.Response:
        response = responses.whole(200, b"{}")
        response.after = lambda: events.append("recorded")
        return response

    async def send(message: Any) -> None:
        events.append(message["type"])

    await send_answer(answer(), send)
    assert events == ["http.response.start", "http.response.body", "recorded"]

    events.clear()

    async def client_gone(message: Any) -> None:
        raise OSError("connection reset")

    with pytest.raises(OSError):
        await send_answer(answer(), client_gone)
    assert events == ["recorded"]

    events.clear()
    stuck = asyncio.Event()

    async def never_written(message: Any) -> None:
        await stuck.wait()

    writing = asyncio.ensure_future(send_answer(answer(), never_written))
    await asyncio.sleep(0)
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert events == ["recorded"]
