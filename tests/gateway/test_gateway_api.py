"""The ninja operations behind ``/v1``, called through Django's own test client (the stock
handler, not ``GatewayHandler``'s fast path): the same answers either way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from gateway.upstreams import upstreams
from gateway.usage import recorder
from tests.harness.factories import make_key
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
