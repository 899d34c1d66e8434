"""Which listener answers what (``llmgw_site.listeners``): the table behind ``--admin-listen``,
``--metrics-listen`` and ``--agent-ws-listen`` (S4), and the web process's application acting on
it (``llmgw_site.asgi``)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw_site import listeners
from llmgw_site.listeners import (
    ANY,
    ROLE_NAMES,
    ROLES,
    Answer,
    Route,
    decide,
    listener_of,
    parse_ports,
    ports_value,
    role_of,
)
from tests.harness.asgi import call_http, call_websocket

NONE: frozenset[str] = frozenset()
ALL = frozenset({"admin", "metrics", "agent"})


@pytest.mark.parametrize(
    ("path", "answer"),
    [
        ("/v1/chat/completions", Answer.V1),
        ("/v1", Answer.V1),
        ("/healthz", Answer.HEALTH),
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
        ("client", "/healthz", Answer.HEALTH),
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
        ("agent", "/healthz", Answer.HEALTH),
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


# A path of each kind of route: itself, one under a prefix, one a catch-all takes.
SAMPLES = {"/v1/*": "/v1/models", ANY: "/admin/login/"}
WS_SAMPLE = "/agents/stream"


def sample(route: Route) -> str:
    if route.kind == "websocket":
        return WS_SAMPLE
    return SAMPLES.get(route.path, route.path)


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_each_listener_serves_its_role_s_paths_and_no_other_role_s(role: str) -> None:
    """With a listener for every role: each answers its own routes, and every path of another
    role's is 404 there (a /healthz both serve aside)."""
    own = listeners.ROLES[ROLE_NAMES.index(role)].serves
    for route in own:
        assert decide(role, ALL, route.kind, sample(route)) is route.answer, route
    mine = {(route.kind, sample(route)) for route in own}
    for other in ROLES:
        for route in other.serves:
            if other.name != role and (route.kind, sample(route)) not in mine:
                assert decide(role, ALL, route.kind, sample(route)) is Answer.NOT_FOUND, route


@pytest.mark.parametrize("role", [r.name for r in ROLES if r.without_listener])
def test_a_role_without_a_listener_of_its_own_is_served_on_the_client_listener(role: str) -> None:
    split = ALL - {role}
    assert listener_of(role, split) == "client" and listener_of(role, ALL) == role
    for route in ROLES[ROLE_NAMES.index(role)].without_listener:
        assert decide("client", split, route.kind, sample(route)) is route.answer, route


def test_the_listener_ports_travel_in_one_variable() -> None:
    ports = {"client": 8000, "admin": 8001, "metrics": 8002, "agent": 8003}
    assert parse_ports(ports_value(ports)) == {port: role for role, port in ports.items()}


PORTS = {"client": 8000, "admin": 8001, "metrics": 8002, "agent": 8003}


@pytest.fixture
def every_listener(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The web process's application as if it accepted on a listener for every role."""
    from llmgw_site import asgi

    monkeypatch.setattr(asgi, "PORTS", {port: role for role, port in PORTS.items()})
    monkeypatch.setattr(asgi, "ROUTERS", listeners.routers(ALL))
    return asgi.application


def test_every_answer_of_the_table_has_an_application() -> None:
    from llmgw_site.asgi import ANSWERS

    assert set(ANSWERS) == set(Answer)


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLE_NAMES)
async def test_the_application_answers_as_the_table_says(role: str, every_listener: Any) -> None:
    """Each sample path of every role, on the listener of each: our 404 (a WebSocket closed
    with 4404) where the table says not found, and someone else's answer where it does not."""
    port = PORTS[role]
    for route in [route for each in ROLES for route in each.serves]:
        path = sample(route)
        answer = decide(role, ALL, route.kind, path)
        if route.kind == "websocket":
            closed = await call_websocket(every_listener, path, port=port)
            assert (closed.get("code") == 4404) is (answer is Answer.NOT_FOUND), (path, closed)
            continue
        status, body = await call_http(every_listener, path, port=port)
        ours = status == 404 and body == b'{"error":"not found"}'
        assert ours is (answer is Answer.NOT_FOUND), (path, status)
