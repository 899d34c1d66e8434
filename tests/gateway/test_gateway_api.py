"""The ninja operations behind ``/v1``, called through Django's own test client (the stock
handler), against what ``gateway.edge.asgi`` and ``llmgw_site.asgi`` answer without Django: the same
answers either way; and what a web process imports only on first use."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from gateway.ledger.usage import recorder
from gateway.routing.upstreams import upstreams
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


async def test_the_ninja_views_answer_like_the_fast_path() -> None:
    key, _ = await sync_to_async(make_key)()
    await upstreams.refresh()
    client = AsyncClient()
    auth = {"Authorization": f"Bearer {key}"}
    body = json.dumps({"model": "nothing-here", "messages": []})
    missing = await client.post(
        "/v1/chat/completions", body, content_type="application/json", headers=auth
    )
    assert missing.status_code == 404
    assert json.loads(missing.content)["error"]["code"] == "model_not_found"
    anonymous = await client.post("/v1/embeddings", body, content_type="application/json")
    assert anonymous.status_code == 401
    assert json.loads(anonymous.content)["error"]["code"] == "invalid_api_key"
    wrong_type = await client.post(
        "/v1/completions", json.dumps({"model": 3}), content_type="application/json", headers=auth
    )
    assert wrong_type.status_code == 400
    assert json.loads(wrong_type.content)["error"]["param"] == "model"
    listing = await client.get("/v1/models", headers=auth)
    assert listing.status_code == 200 and json.loads(listing.content)["object"] == "list"


Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def call_asgi(
    app: Asgi, path: str, method: str = "GET", key: str | None = None
) -> tuple[int, bytes]:
    """One bodiless request through an ASGI application, as a server would hand it over."""
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "headers": headers}
    scope |= {"query_string": b"", "root_path": "", "server": ("127.0.0.1", 80)}
    scope |= {"client": ("127.0.0.1", 5), "scheme": "http", "http_version": "1.1"}
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def call_v1(path: str, method: str = "GET", key: str | None = None) -> tuple[int, bytes]:
    """One request through ``gateway.edge.asgi``'s application, failing if the application hands it
    to Django's handler."""
    from gateway.edge.asgi import V1App

    async def not_through_django(*args: Any) -> None:
        raise AssertionError(f"{method} {path} went to Django's handler (ninja)")

    app = V1App()
    app._django.respond = not_through_django  # type: ignore[method-assign,assignment]
    return await call_asgi(app, path, method, key)


async def call_site(path: str) -> tuple[int, bytes]:
    """One GET through the web process's whole application (``llmgw_site.asgi``)."""
    from llmgw_site.asgi import application

    return await call_asgi(application, path)


async def test_healthz_answers_as_the_django_view_does() -> None:
    status, body = await call_site("/healthz")
    view = await AsyncClient().get("/healthz")
    assert status == view.status_code == 200
    assert json.loads(body) == json.loads(view.content)
    assert json.loads(body)["database"] == "reachable"


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
        ninja = await AsyncClient().get("/v1/models", headers={"Authorization": f"Bearer {each}"})
        assert status == ninja.status_code == 200
        assert json.loads(body) == json.loads(ninja.content)
    assert [m["id"] for m in json.loads(body)["data"]] == ["chat-b"]
    for bad in (None, key + "x", "not-a-key"):
        status, body = await call_v1("/v1/models", key=bad)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


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
