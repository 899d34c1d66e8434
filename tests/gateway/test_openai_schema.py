"""G16: Schemathesis generates requests from the published ``/v1/openapi.json`` and sends them
to a live llmgw web process in front of a live ``sim``: no 5xx, and every response matches
what the document says (status, content type, body schema)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.harness.factories import make_key, serve_model
from tests.harness.live import Stack, gateway_stack, http
from tests.harness.procs import Proc
from tests.harness.waits import wait_until

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def live(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # "string" is the model name generators try first.
    with gateway_stack(tmp_path_factory.mktemp("schema"), ["string", "m"], engines=1) as live:
        yield live


@pytest.fixture
def stack(live: Stack) -> Iterator[tuple[Proc, Proc]]:
    live.begin()
    yield live.web, live.engines[0]
    live.settle()


@pytest.fixture
def bearer(stack: tuple[Proc, Proc]) -> dict[str, str]:
    web, sim = stack
    key, _ = make_key()
    serve_model("string", [sim.port])
    serve_model("m", [sim.port])
    wait_until(lambda: b'"string"' in http("GET", web.url + "/v1/models", key=key)[2])
    return {"Authorization": f"Bearer {key}"}


def exercise(operation: Any, bearer: dict[str, str], seen: dict[str, set[int]]) -> None:
    """Up to 25 generated requests for one operation, each answer checked."""
    calls = [0]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def one(case: Any) -> None:
        # Half the bodies name a served model, so generated data reaches the engine too
        # (random names stop at the gateway's 404).
        calls[0] += 1
        if isinstance(case.body, dict) and "model" in case.body and calls[0] % 2:
            case.body["model"] = "m"
        response = case.call(headers=bearer, timeout=60)
        assert response.status_code < 500, (case.path, case.body, response.text)
        # Not `positive_data_acceptance`: a body valid by the gateway's document may still be
        # refused by the engine (its own validation of messages, roles ...), and relaying the
        # engine's 400 is right for a relay.
        case.validate_response(response, headers=bearer, checks=CHECKS)
        seen.setdefault(operation.label, set()).add(response.status_code)

    one()


def test_generated_requests_get_no_5xx_and_documented_answers(
    stack: tuple[Proc, Proc], bearer: dict[str, str]
) -> None:
    # Driven through Hypothesis directly: schemathesis's pytest plugin does not load under
    # this pytest version ('Function' object has no attribute '_nodeid').
    web, _ = stack
    api = schemathesis.openapi.from_url(web.url + "/v1/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) == 7
    seen: dict[str, set[int]] = {}
    for operation in operations:
        exercise(operation, bearer, seen)
    assert set(seen) == {op.label for op in operations}
    # The generated traffic reached the engine, not only the gateway's own refusals.
    assert 200 in seen["POST /v1/chat/completions"] | seen["POST /v1/completions"]
