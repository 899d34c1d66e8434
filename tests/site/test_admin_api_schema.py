"""Schemathesis generates requests from the admin API's own OpenAPI document
(``/api/admin/v1/openapi.json``) and sends them, with a read-write admin token, to the site's
WSGI application on the test database: no 5xx, and every answer matches the document
(status, content type, body schema), errors included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from tests.harness.factories import make_key, make_model, make_node, make_replica, make_usage

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def keep_the_test_connection() -> Iterator[None]:
    """The WSGI handler closes the database connection after each request; the test's
    transaction lives on it. Django's own test client disconnects the same signals."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def exercise(operation: Any, headers: dict[str, str], seen: dict[str, set[int]]) -> None:
    @given(case=operation.as_strategy())
    @settings(
        max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def one(case: Any) -> None:
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        case.validate_response(response, headers=headers, checks=CHECKS)
        seen.setdefault(operation.label, set()).add(response.status_code)

    one()


def test_generated_requests_get_no_5xx_and_documented_answers() -> None:
    node = make_node("string")
    make_replica(make_model("string"), [(node, [0])])
    _, key = make_key("string")
    make_usage(model="string", api_key=key)
    headers = {
        "Authorization": f"Bearer {tokens.issue('fuzz', scope=AdminToken.Scope.WRITE).token}"
    }
    api = schemathesis.openapi.from_wsgi("/api/admin/v1/openapi.json", get_wsgi_application())
    operations = [result.ok() for result in api.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 40
    seen: dict[str, set[int]] = {}
    for operation in operations:
        exercise(operation, headers, seen)
    assert set(seen) == {op.label for op in operations}
    # Generated data got past validation somewhere, not only refusals.
    assert any(code < 300 for codes in seen.values() for code in codes)
