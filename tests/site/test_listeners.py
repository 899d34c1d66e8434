"""Which listener answers what (``llmgw_site.listeners``): the table behind ``--admin-listen``,
``--metrics-listen`` and ``--agent-ws-listen`` (S4), and the web process's application acting on
it (``llmgw_site.asgi``)."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import CommandError, call_command

from llmgw_site import listeners
from llmgw_site.listeners import (
    ANY,
    ROLE_NAMES,
    ROLES,
    Answer,
    Route,
    decide,
    listener_of,
    listeners_value,
    parse_listeners,
    role_of,
    sharing_a_port,
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


def test_the_role_is_the_listener_the_connection_came_in_on() -> None:
    table = parse_listeners(
        "client=127.0.0.1:8000,admin=127.0.0.1:8001,bogus=127.0.0.1:1,metrics=x,agent=8003"
    )
    assert table == {("127.0.0.1", 8000): "client", ("127.0.0.1", 8001): "admin"}
    assert role_of(table, ("127.0.0.1", 8001)) == "admin"
    assert role_of(table, ("127.0.0.1", 8000)) == "client"
    assert role_of(table, None) == "client"  # a server that does not say
    assert role_of({}, ("127.0.0.1", 8001)) == "client"


def test_two_roles_on_one_port_are_told_apart_by_the_address_of_their_sockets() -> None:
    """``--host 10.0.0.5 --port 8000`` beside an admin listener on 127.0.0.1:8000: the public
    address is the client's, whatever the port says."""
    table = {("10.0.0.5", 8000): "client", ("127.0.0.1", 8000): "admin"}
    assert role_of(table, ("10.0.0.5", 8000)) == "client"
    assert role_of(table, ("127.0.0.1", 8000)) == "admin"
    # An address no listener of this process is bound to is never the admin's.
    assert role_of(table, ("127.0.0.2", 8000)) == "client"
    assert role_of(table, ("10.0.0.5", 8001)) == "client"


def test_a_listener_bound_to_every_address_owns_its_port_at_each_of_them() -> None:
    table = {("0.0.0.0", 8000): "client", ("127.0.0.1", 8001): "admin", ("::", 8003): "agent"}
    assert role_of(table, ("10.0.0.5", 8000)) == "client"
    assert role_of(table, ("127.0.0.1", 8000)) == "client"
    # The admin is bound to loopback alone: the same port at another address is not its.
    assert role_of(table, ("10.0.0.5", 8001)) == "client"
    assert role_of(table, ("::1", 8003)) == "agent"
    # A dual-stack socket's IPv4 clients, however the server writes their address.
    assert role_of(table, ("::ffff:10.0.0.5", 8003)) == "agent"
    assert role_of(table, ("10.0.0.5", 8003)) == "agent"
    assert role_of(table, ("::ffff:127.0.0.1", 8001)) == "admin"


def test_a_listener_bound_to_one_address_wins_over_one_bound_to_every_address() -> None:
    """Where the system lets both bind one port (or IPv4 and IPv6 wildcards on one port with
    ``IPV6_V6ONLY``), the socket bound to the connection's own address is the one it came in on."""
    table = {("0.0.0.0", 8000): "client", ("127.0.0.1", 8000): "admin", ("::", 8000): "agent"}
    assert role_of(table, ("127.0.0.1", 8000)) == "admin"
    assert role_of(table, ("10.0.0.5", 8000)) == "client"
    assert role_of(table, ("::1", 8000)) == "agent"


def test_the_listeners_travel_in_one_variable() -> None:
    table = {
        ("10.0.0.5", 8000): "client",
        ("127.0.0.1", 8000): "admin",
        ("::1", 8002): "metrics",
        ("::", 8003): "agent",
    }
    assert parse_listeners(listeners_value(table)) == table
    assert listeners_value({("::1", 8002): "metrics"}) == "metrics=[::1]:8002"
    assert parse_listeners("client=[::ffff:10.0.0.5]:8000") == {("10.0.0.5", 8000): "client"}


def test_listeners_sharing_a_port_are_found_whatever_their_addresses() -> None:
    public, private = ("10.0.0.5", 8000), ("127.0.0.1", 8000)
    assert sharing_a_port({"--port 8000": public, "--admin-listen 127.0.0.1:8000": private}) == (
        8000,
        ["--port 8000", "--admin-listen 127.0.0.1:8000"],
    )
    assert sharing_a_port({"a": public, "b": ("127.0.0.1", 8001), "c": ("::", 8002)}) is None
    # Port 0 is one the kernel picks: a port of its own each time.
    assert sharing_a_port({"a": ("127.0.0.1", 0), "b": ("127.0.0.2", 0)}) is None


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--host", "10.0.0.5", "--port", "8000", "--admin-listen", "127.0.0.1:8000"],
            ["--host 10.0.0.5 --port 8000", "--admin-listen 127.0.0.1:8000"],
        ),
        (["--port", "8000", "--metrics-listen", "8000"], ["--port 8000", "--metrics-listen 8000"]),
        (
            ["--port", "8000", "--admin-listen", "9000", "--agent-ws-listen", "[::1]:9000"],
            ["--admin-listen 9000", "--agent-ws-listen [::1]:9000"],
        ),
        (
            ["--port", "8000", "--agent-ws-listen", "9001", "--agent-listen", "0.0.0.0:9001"],
            ["--agent-ws-listen 9001", "--agent-listen 0.0.0.0:9001"],
        ),
    ],
)
def test_run_refuses_two_listeners_on_one_port_before_it_touches_anything(
    flags: list[str], named: list[str]
) -> None:
    """Refused before the store is migrated or a socket bound (this test has no database)."""
    with pytest.raises(CommandError) as refused:
        call_command("run", "--no-agent", *flags)
    said = str(refused.value)
    assert " and ".join(named) in said and "port of its own" in said, said


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


PORTS = {"client": 8000, "admin": 8001, "metrics": 8002, "agent": 8003}


@pytest.fixture
def every_listener(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The web process's application as if it accepted on a listener for every role."""
    from llmgw_site import asgi

    monkeypatch.setattr(
        asgi, "LISTENERS", {("127.0.0.1", port): role for role, port in PORTS.items()}
    )
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
