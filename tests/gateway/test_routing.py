"""Routing decisions (``gateway.routing.table``), pure: no database, no clock, no network."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.addresses import upstream_url_problem
from gateway.routing.table import (
    CatalogRow,
    EndpointRow,
    ReplicaRow,
    Table,
    Upstream,
    base_url,
    build_table,
    choose,
)

LLAMA = CatalogRow(id=1, name="llama", aliases=("l3", "mistral"), activation_timeout_s=30)
MISTRAL = CatalogRow(id=2, name="mistral")
OFF = CatalogRow(id=3, name="retired", enabled=False)


def table() -> Table:
    return build_table(
        [LLAMA, MISTRAL, OFF],
        [
            ReplicaRow(10, 1, "fast", "10.0.0.1", 8000),
            ReplicaRow(11, 1, "small", "10.0.0.2", 8001),
            ReplicaRow(12, 3, "fast", "10.0.0.3", 8002),
        ],
        [
            EndpointRow("static:ext", "http://10.1.0.1:9000/v1/", ("llama", "gpt-x"), 3),
        ],
        profiles={1: ["fast", "small", "big"], 2: ["fast"]},
    )


def test_a_name_resolves_to_every_ready_replica_and_endpoint_of_the_model() -> None:
    route = table().resolve("llama")
    assert route is not None
    assert route.catalog_id == 1 and route.activation_timeout_s == 30
    assert [u.id for u in route.upstreams] == ["replica:10", "replica:11", "static:ext"]
    assert route.upstreams[0].base_url == "http://10.0.0.1:8000"
    assert route.upstreams[2] == Upstream("static:ext", "http://10.1.0.1:9000", 3)


def test_an_alias_resolves_to_its_model_but_never_shadows_a_real_name() -> None:
    route = table().resolve("l3")
    assert route is not None and route.name == "llama"
    # "mistral" is llama's alias *and* a model of its own: the model wins.
    shadowed = table().resolve("mistral")
    assert shadowed is not None and shadowed.name == "mistral"


def test_name_at_profile_narrows_to_that_profiles_replicas() -> None:
    route = table().resolve("llama@small")
    assert route is not None and [u.id for u in route.upstreams] == ["replica:11"]
    cold = table().resolve("llama@big")  # a profile of the model with nothing running yet
    assert cold is not None and cold.upstreams == () and cold.catalog_id == 1
    assert table().resolve("llama@nonexistent") is None


def test_disabled_and_unknown_models_do_not_resolve() -> None:
    assert table().resolve("retired") is None
    assert table().resolve("nothing") is None
    assert table().resolve("http://10.0.0.1:8000/v1") is None


def test_a_model_served_only_by_static_endpoints_has_no_catalog_entry() -> None:
    route = table().resolve("gpt-x")
    assert route is not None and route.catalog_id is None
    assert [u.id for u in route.upstreams] == ["static:ext"]
    assert table().model_names() == ["gpt-x", "llama", "mistral"]


A = Upstream("a", "http://a:1")
B = Upstream("b", "http://b:1")
HEAVY = Upstream("h", "http://h:1", weight=3)


def test_least_outstanding_wins() -> None:
    assert choose([A, B], {"a": 2, "b": 1}, {}, 0.0) == B
    assert choose([A, B], {"a": 0, "b": 1}, {}, 0.0) == A


def test_weight_divides_the_load() -> None:
    # (2+1)/3 = 1 < (1+1)/1 = 2: the heavy upstream takes a third request before A takes a second.
    assert choose([A, HEAVY], {"a": 1, "h": 2}, {}, 0.0) == HEAVY
    assert choose([A, HEAVY], {"a": 1, "h": 6}, {}, 0.0) == A


def test_ties_rotate_so_idle_upstreams_share_requests() -> None:
    picks = Counter(
        choose([A, B], {}, {}, 0.0, offset=i).id  # type: ignore[union-attr]
        for i in range(10)
    )
    assert picks == {"a": 5, "b": 5}


def test_ejected_upstreams_are_skipped_until_their_cool_down_ends() -> None:
    ejected = {"a": 100.0}
    assert choose([A, B], {"b": 50}, ejected, now=99.0) == B
    assert choose([A, B], {"b": 50}, ejected, now=100.0) == A


def test_when_all_are_ejected_one_is_still_tried() -> None:
    assert choose([A], {}, {"a": 100.0}, now=0.0) == A


def test_excluded_upstreams_are_never_chosen() -> None:
    assert choose([A, B], {"b": 9}, {}, 0.0, exclude={"a"}) == B
    assert choose([A, B], {}, {}, 0.0, exclude={"a", "b"}) is None
    assert choose([], {}, {}, 0.0) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",
        "http://[fe80::1]:8000",
        "http://metadata.google.internal/",
        "file:///etc/passwd",
        "gopher://10.0.0.1/",
        "http://0.0.0.0:8000",
        "http://[::ffff:169.254.169.254]/",
        "http://[fd00:ec2::254]/",
        "http:///nohost",
    ],
)
def test_metadata_link_local_and_odd_schemes_are_refused(url: str) -> None:
    assert upstream_url_problem(url) is not None


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000/v1", "https://engine.internal"])
def test_private_and_named_hosts_are_allowed(url: str) -> None:
    assert upstream_url_problem(url) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://2852039166/",  # 169.254.169.254 as one decimal number
        "http://0xa9fea9fe/",  # ... in hex
        "http://0251.0376.0251.0376/",  # ... in octal
        "http://127.0.0.1:8000",
        "http://2130706433:8000",  # 127.0.0.1 as one number
        "http://localhost:8000",
        "http://[::ffff:127.0.0.1]/",
    ],
)
def test_numeric_forms_of_metadata_and_loopback_are_refused_as_resolvers_read_them(
    url: str,
) -> None:
    """A resolver reads these as the addresses they encode; so does the check."""
    assert upstream_url_problem(url) is not None


def test_ipv6_hosts_get_brackets() -> None:
    assert base_url("fd00::5", 8000) == "http://[fd00::5]:8000"


def test_a_plain_name_prefers_its_default_profiles_replicas() -> None:
    llama = CatalogRow(id=1, name="llama", default_profile="small")
    rows = [ReplicaRow(10, 1, "fast", "10.0.0.1", 8000), ReplicaRow(11, 1, "small", "h", 8001)]
    both = build_table([llama], rows, [], profiles={1: ["fast", "small"]})
    route = both.resolve("llama")
    assert route is not None and route.profile is None
    assert [u.id for u in route.upstreams] == ["replica:11"]
    # With the default profile cold, the others serve plain requests meanwhile.
    only_fast = build_table([llama], rows[:1], [], profiles={1: ["fast", "small"]})
    fallback = only_fast.resolve("llama")
    assert fallback is not None and [u.id for u in fallback.upstreams] == ["replica:10"]


def test_name_at_profile_is_served_only_by_that_profile_and_says_which() -> None:
    llama = CatalogRow(id=1, name="llama", default_profile="small")
    rows = [ReplicaRow(11, 1, "small", "h", 8001)]
    cold = build_table([llama], rows, [], profiles={1: ["fast", "small"]})
    route = cold.resolve("llama@fast")
    assert route is not None and route.profile == "fast" and route.upstreams == ()
    assert not route.default_profile, "its demand starts a replica under fast"
    default = cold.resolve("llama@small")
    assert default is not None and default.profile == "small" and default.default_profile
    assert [u.id for u in default.upstreams] == ["replica:11"]
    only_fast = build_table(
        [llama], [ReplicaRow(10, 1, "fast", "h", 8000)], [], profiles={1: ["fast", "small"]}
    )
    explicit = only_fast.resolve("llama@small")
    assert explicit is not None and explicit.upstreams == (), "never served by fast"


async def test_a_replica_going_busy_after_an_idle_spell_is_reported_shortly_not_at_once() -> None:
    """Within moments (the reconciler must not take it for idle), but not while the request
    that made it busy waits for its first bytes (the report's queries would hold the GIL)."""
    import asyncio

    from gateway.routing.upstreams import BUSY_REPORT_DELAY_S, Upstreams

    upstreams = Upstreams()
    upstreams._loop = asyncio.get_running_loop()
    upstreams._wake = wake = asyncio.Event()
    replica = Upstream("replica:7", "http://10.0.0.1:8000")
    hold = upstreams.acquire(replica)
    await asyncio.sleep(0)
    assert not wake.is_set()
    await asyncio.sleep(BUSY_REPORT_DELAY_S * 2)
    assert wake.is_set()
    wake.clear()
    upstreams.release(hold)
    upstreams.acquire(replica)  # busy again right after: its finish is recent use already
    await asyncio.sleep(BUSY_REPORT_DELAY_S * 2)
    assert not wake.is_set()
