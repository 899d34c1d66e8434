"""Which listener answers what (``llmgw_site.listeners``): the pure decisions behind
``--admin-listen``, ``--metrics-listen`` and ``--agent-ws-listen`` (S4)."""

from __future__ import annotations

import pytest

from llmgw_site.listeners import Answer, decide, parse_ports, role_of

NONE: frozenset[str] = frozenset()
ALL = frozenset({"admin", "metrics", "agent"})


@pytest.mark.parametrize(
    ("path", "answer"),
    [
        ("/v1/chat/completions", Answer.V1),
        ("/v1", Answer.V1),
        ("/healthz", Answer.SITE),
        ("/admin/", Answer.SITE),
        ("/account/", Answer.SITE),
        ("/metrics", Answer.SITE),
    ],
)
def test_one_port_serves_everything_as_before(path: str, answer: Answer) -> None:
    assert decide("client", NONE, "http", path) is answer
    assert decide("client", NONE, "websocket", "/agents/stream") is Answer.AGENTS


@pytest.mark.parametrize(
    ("role", "path", "answer"),
    [
        ("client", "/v1/models", Answer.V1),
        ("client", "/healthz", Answer.SITE),
        ("client", "/admin/", Answer.NOT_FOUND),
        ("client", "/admin/dashboard.json", Answer.NOT_FOUND),
        ("client", "/account/", Answer.NOT_FOUND),
        ("client", "/static/admin/css/base.css", Answer.NOT_FOUND),
        ("client", "/metrics", Answer.NOT_FOUND),
        ("admin", "/admin/", Answer.SITE),
        ("admin", "/account/", Answer.SITE),
        ("admin", "/v1/models", Answer.NOT_FOUND),
        ("admin", "/metrics", Answer.NOT_FOUND),
        ("metrics", "/metrics", Answer.OPEN_METRICS),
        ("metrics", "/admin/", Answer.NOT_FOUND),
        ("metrics", "/v1/models", Answer.NOT_FOUND),
        ("agent", "/healthz", Answer.SITE),
        ("agent", "/admin/", Answer.NOT_FOUND),
        ("agent", "/v1/models", Answer.NOT_FOUND),
    ],
)
def test_split_listeners_serve_only_their_part(role: str, path: str, answer: Answer) -> None:
    assert decide(role, ALL, "http", path) is answer


def test_agent_streams_go_only_to_the_agent_listener_once_it_exists() -> None:
    assert decide("agent", ALL, "websocket", "/agents/stream") is Answer.AGENTS
    for role in ("client", "admin", "metrics"):
        assert decide(role, ALL, "websocket", "/agents/stream") is Answer.NOT_FOUND
    # The admin moved away, the agents did not: they stay on the client port.
    assert decide("client", frozenset({"admin"}), "websocket", "/agents/stream") is Answer.AGENTS


def test_metrics_with_a_token_stay_on_the_client_port_without_a_metrics_listener() -> None:
    assert decide("client", frozenset({"admin"}), "http", "/metrics") is Answer.SITE


def test_the_role_is_the_local_port_the_request_came_in_on() -> None:
    ports = parse_ports("client=8000,admin=8001,bogus=1,metrics=x")
    assert ports == {8000: "client", 8001: "admin"}
    assert role_of(ports, ("127.0.0.1", 8001)) == "admin"
    assert role_of(ports, ("127.0.0.1", 8000)) == "client"
    assert role_of(ports, None) == "client"  # a server that does not say
    assert role_of({}, ("127.0.0.1", 8001)) == "client"
