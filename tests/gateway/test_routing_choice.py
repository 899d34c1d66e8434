"""Routing by the cache, as pure functions: prompt blocks, mirrors, and the choice, by table."""

from __future__ import annotations

import bisect
import random
from collections import Counter

import pytest

from gateway.routing import prefix
from gateway.routing.choice import (
    AFFINITY,
    CACHED,
    COLD,
    HOLDER_WAIT_SLACK_S,
    LEAST_LOADED,
    SPILLED,
    Bounds,
    Placement,
    choose_cached,
    rendezvous,
    session_key,
)
from gateway.routing.loads import Loads
from gateway.routing.mirrors import FLOOR_BYTES, Mirror, Mirrors, TokenBytes, matches
from gateway.routing.table import Upstream

A, B, C, D = (Upstream(f"replica:{i}", f"http://10.0.0.{i}:8000") for i in range(1, 5))
FOUR = (A, B, C, D)
BOUNDS = Bounds(factor=1.25, slack=2, cold_slack=2)
SYSTEM = "You are a careful assistant who answers in one line. " * 60  # ~3.2 KB


def chat(*messages: tuple[str, str], tools: object = None) -> dict[str, object]:
    body: dict[str, object] = {"messages": [{"role": r, "content": c} for r, c in messages]}
    if tools is not None:
        body["tools"] = tools
    return body


def blocks(body: dict[str, object], kind: str = "chat") -> prefix.PromptBlocks:
    return prefix.blocks_of(kind, body, block_bytes=512, max_blocks=256)


def full_blocks(size: int, block_bytes: int = 512) -> int:
    """How many blocks of a prompt end within its first ``size`` bytes."""
    return bisect.bisect_right(prefix.block_ends(block_bytes, 256), size)


# The written-out system message: its role, a separator, its text and the message's end.
SYSTEM_BYTES = len("system") + 1 + len(SYSTEM) + 1

# --------------------------------------------------------------------------- prompt blocks


def test_blocks_grow_from_a_quarter_kilobyte_to_the_block_size_then_stay() -> None:
    assert prefix.block_ends(4096, 9) == (256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 20480)
    assert prefix.block_ends(64, 4) == (64, 128, 192, 256)  # blocks no larger than asked
    short = blocks(chat(("user", "Is this short question told apart? " * 8)))
    assert len(short.keys) == 1  # a chat's short first turn has a block
    long = prefix.blocks_of("chat", chat(("user", "w" * 32_000)), 1024, 512)
    assert len(long.keys) == 33  # 256, 512, then every 1,024 up to 32,000 bytes
    assert long.bytes_through(3) == 1024 and long.bytes_through(0) == 0
    assert long.bytes_through(99) == 31_744  # no further than its last full block


def test_prompts_that_share_a_prefix_share_exactly_its_full_blocks() -> None:
    one = blocks(chat(("system", SYSTEM), ("user", "What is two and two? " * 40)))
    two = blocks(chat(("system", SYSTEM), ("user", "Name a prime. " * 60)))
    shared = full_blocks(SYSTEM_BYTES)  # every block wholly inside the system message
    assert one.keys[:shared] == two.keys[:shared]
    assert one.keys[shared:] and two.keys[shared:]
    assert not set(one.keys[shared:]) & set(two.keys[shared:])
    assert one.lead == two.lead


def test_each_block_key_covers_everything_before_it() -> None:
    # The same bytes in later blocks after a different first block are other keys.
    tail = "x" * 2048
    one = blocks(chat(("user", "a" * 512 + tail)))
    two = blocks(chat(("user", "b" * 512 + tail)))
    assert not set(one.keys) & set(two.keys)


def test_a_growing_chat_history_extends_the_previous_turns_blocks() -> None:
    turn1 = chat(("system", SYSTEM), ("user", "Tell me a long story. " * 30))
    turn2 = chat(
        ("system", SYSTEM),
        ("user", "Tell me a long story. " * 30),
        ("assistant", "Once upon a time. " * 50),
        ("user", "And then?"),
    )
    first, second = blocks(turn1), blocks(turn2)
    assert second.keys[: len(first.keys)] == first.keys


def test_tools_come_after_the_system_prompt_and_before_the_conversation() -> None:
    tools = [{"type": "function", "function": {"name": "f" * 600, "parameters": {}}}]
    with_tools = blocks(chat(("system", SYSTEM), ("user", "hi"), tools=tools))
    without = blocks(chat(("system", SYSTEM), ("user", "hi")))
    system_blocks = full_blocks(SYSTEM_BYTES)
    assert with_tools.keys[:system_blocks] == without.keys[:system_blocks]
    assert with_tools.size > without.size


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("embeddings", {"input": "x" * 5000}),
        ("rerank", {"query": "q", "documents": ["x" * 5000]}),
        ("chat", {"messages": "not a list"}),
        ("chat", {"messages": [{"role": "user", "content": "short"}]}),
        ("completions", {"prompt": None}),
    ],
)
def test_requests_without_a_full_prompt_block_have_no_keys(
    kind: str, body: dict[str, object]
) -> None:
    assert blocks(body, kind).lead is None


def test_completion_prompts_and_responses_inputs_are_blocked_too() -> None:
    text = "z" * 2000
    assert len(blocks({"prompt": text}, "completions").keys) == full_blocks(2000) == 4
    assert len(blocks({"prompt": list(range(400))}, "completions").keys) >= 1
    responses = blocks({"instructions": SYSTEM, "input": "hello"}, "responses")
    assert len(responses.keys) == full_blocks(len(SYSTEM) + len("hello"))


def test_hostile_content_never_raises_and_huge_prompts_are_capped() -> None:
    weird = chat(("user", "x" * 600))
    weird["messages"].append({"role": 7, "content": [{"type": "image_url", "x": [1, {}]}]})  # type: ignore[attr-defined]
    weird["messages"].append("a bare string")  # type: ignore[attr-defined]
    assert blocks(weird).lead is not None
    huge = prefix.blocks_of("chat", chat(("user", "y" * 1_000_000)), 512, max_blocks=64)
    assert len(huge.keys) == 64
    assert prefix.blocks_of("chat", {"messages": [{"content": 2**70}]}, 512, 64).lead is None


@pytest.mark.parametrize(
    ("cached", "prompt", "expected"),
    # 4,096 bytes in blocks ending at 256, 512, 1,024, then every 512: nine blocks.
    [(0, 1000, 0), (500, 1000, 5), (1000, 1000, 9), (2000, 1000, 9), (5, 0, 0), (60, 1000, 0)],
)
def test_an_engines_cached_tokens_cover_the_same_share_of_blocks(
    cached: int, prompt: int, expected: int
) -> None:
    written = prefix.chain(b"q" * 4096, 512, 256)
    assert prefix.covering(written, cached, prompt) == expected


# --------------------------------------------------------------------------- mirrors

ENDS = prefix.block_ends(512, 256)  # 256, 512, 1,024, then every 512


def test_a_mirror_forgets_least_recently_used_blocks_tail_first() -> None:
    mirror = Mirror(ceiling=FLOOR_BYTES)
    first = tuple(range(100, 100 + 64))  # 32,256 bytes of blocks: almost the whole ceiling
    mirror.hold(first, ENDS)
    assert len(mirror) == 64 and mirror.held == ENDS[63]
    mirror.hold((1, 2, 3), ENDS)  # three new blocks (1,024 bytes) push the first one's tail out
    assert 100 in mirror and 101 in mirror and 1 in mirror and 3 in mirror
    assert first[-1] not in mirror and first[-2] in mirror
    assert mirror.held == FLOOR_BYTES


def test_a_placement_of_more_blocks_than_a_prompt_is_cut_into_is_held_to_its_head() -> None:
    # A peer's datagram may carry more keys than this process cuts a prompt into.
    mirrors = Mirrors(default_ceiling=1_000_000, block_bytes=512, max_blocks=8)
    mirrors.hold("a", tuple(range(1000)))
    assert len(mirrors.by_upstream["a"]) == 8 and mirrors.by_upstream["a"].depth(range(9)) == 8


def test_matches_walk_each_upstream_to_its_first_missing_block() -> None:
    mirrors = {"a": Mirror(100_000), "b": Mirror(100_000), "c": Mirror(100_000)}
    mirrors["a"].hold((1, 2, 3, 4), ENDS)
    mirrors["b"].hold((1, 2), ENDS)
    mirrors["c"].hold((9,), ENDS)
    assert matches(mirrors, ["a", "b", "c", "d"], (1, 2, 3)) == {"a": 3, "b": 2, "c": 0}


def test_an_engine_that_denies_a_prediction_shrinks_the_mirror_and_one_that_had_more_grows_it() -> (
    None
):
    mirrors = Mirrors(default_ceiling=400_000, block_bytes=512, max_blocks=1000)
    mirrors.hold("a", tuple(range(800)))  # 400,000 bytes: all of it
    mirror = mirrors.by_upstream["a"]
    assert len(mirror) == 782 and mirror.held <= 400_000
    assert mirrors.learn("a", predicted=10, confirmed=10).outcome == "agreed"
    assert mirrors.learn("a", predicted=10, confirmed=9).outcome == "agreed"  # rounding
    denied = mirrors.learn("a", predicted=10, confirmed=0)
    assert denied.outcome == "denied"
    assert mirror.capacity == 300_000  # three quarters of it, the oldest blocks gone
    assert mirror.held <= 300_000 and 0 in mirror and 799 not in mirror
    assert mirrors.learn("a", predicted=0, confirmed=100).outcome == "surprised"
    assert mirror.capacity == 300_000 + ENDS[99]  # grown by the hundred blocks' bytes
    for _ in range(50):
        mirrors.learn("a", predicted=0, confirmed=500)
    assert mirror.capacity == 400_000  # never past the upstream's cache size


def test_a_restarted_drained_or_departed_upstream_is_forgotten() -> None:
    mirrors = Mirrors(default_ceiling=100_000, block_bytes=512, max_blocks=256)
    for uid in ("a", "b", "c"):
        mirrors.hold(uid, (1, 2, 3))
    mirrors.retain({"a": (1, None), "b": (1, None), "c": (1, None)})
    mirrors.retain({"a": (1, None), "b": (2, None)})  # b restarted, c left
    assert set(mirrors.by_upstream) == {"a"}
    mirrors.retain({"a": (1, 20_480)})  # a's cache is now known: 20 KiB of prompt
    mirrors.hold("a", tuple(range(10, 100)))
    assert mirrors.by_upstream["a"].held <= 20_480


def test_an_upstream_whose_whole_cache_is_smaller_than_the_floor_is_remembered_no_larger() -> None:
    mirrors = Mirrors(default_ceiling=100_000, block_bytes=512, max_blocks=256)
    mirrors.retain({"a": (1, 5_000)})
    mirrors.hold("a", tuple(range(100)))
    assert mirrors.by_upstream["a"].held <= 5_000
    assert mirrors.learn("a", predicted=10, confirmed=0).outcome == "denied"
    assert mirrors.by_upstream["a"].capacity == 5_000, "its whole cache is the floor"


def test_bytes_per_token_start_at_four_and_move_toward_what_engines_count() -> None:
    size = TokenBytes()
    assert size.value == 4.0 and size.bytes(1024) == 4096
    for _ in range(100):
        size.learn(size=6000, tokens=1000)
    assert 5.5 < size.value < 6.0
    assert 5.5 * 1024 < size.bytes(1024) < 6 * 1024  # 1,024 tokens of about six bytes
    size.learn(size=6000, tokens=0)  # no count: nothing learned
    size.learn(size=0, tokens=1000)
    assert 5.5 < size.value < 6.0
    before = size.value
    size.learn(size=10**12, tokens=1)  # a count no prompt has moves it one bounded step
    assert size.value - before <= (16.0 - before) / 32
    for _ in range(2000):
        size.learn(size=1, tokens=10**9)
    assert size.value == pytest.approx(1.0), "never below one byte a token"
    assert size.bytes(0) == 1, "a cache is never less than a byte"


# --------------------------------------------------------------------------- the choice


def pick(
    outstanding: dict[str, int] | None = None,
    *,
    lead: int | None = 7,
    affinity: int | None = None,
    matches: dict[str, int] | None = None,
    ejected: dict[str, float] | None = None,
    exclude: tuple[str, ...] = (),
    hot: bool = False,
    bounds: Bounds = BOUNDS,
    starts: dict[str, float] | None = None,
    share: float = 1.0,
) -> tuple[str, str, int]:
    choice = choose_cached(
        FOUR,
        outstanding or {},
        ejected or {},
        0.0,
        placement=Placement(lead, affinity, matches or {}, hot, share),
        bounds=bounds,
        exclude=exclude,
        starts=starts,
    )
    assert choice is not None
    return choice.upstream.id, choice.outcome, choice.predicted


def first_for(key: int) -> str:
    return rendezvous(key, FOUR)[0].id


def test_the_replica_holding_the_longest_prefix_wins() -> None:
    assert pick(matches={"replica:2": 3, "replica:3": 9}) == ("replica:3", CACHED, 9)


def test_the_plain_cached_case_chooses_as_the_full_rule_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where one replica alone holds the longest prefix, the choice takes it without ordering
    all candidates: over random loads, holdings, weights, ejections and tries, it chooses
    exactly as the full rule does with that shortcut taken away."""
    rng = random.Random(11)
    upstreams = (*FOUR, Upstream("endpoint:big", "http://big", weight=3))
    ids = [u.id for u in upstreams]

    def draw() -> dict[str, object]:
        return {
            "outstanding": {uid: rng.randrange(12) for uid in ids if rng.random() < 0.8},
            "ejected_until": {uid: 5.0 for uid in ids if rng.random() < 0.15},
            "exclude": {uid for uid in ids if rng.random() < 0.15},
            "placement": Placement(
                rng.getrandbits(64),
                None,
                {uid: rng.choice((0, 0, 3, 9, 9)) for uid in ids if rng.random() < 0.7},
                rng.random() < 0.3,
                rng.choice((0.2, 0.5, 1.0)),
            ),
            "bounds": Bounds(factor=1.25, slack=rng.choice((1, 4, 32)), cold_slack=1),
            "starts": {uid: rng.random() * 0.05 for uid in ids},
        }

    cases = [draw() for _ in range(3000)]

    def choices() -> list[object]:
        return [choose_cached(upstreams, now=0.0, **case) for case in cases]  # type: ignore[arg-type]

    shortcut = choices()
    monkeypatch.setattr("gateway.routing.choice._sole_holder", lambda *a, **k: None)
    assert shortcut == choices()
    assert sum(c is not None and c.outcome == CACHED for c in shortcut) > 500  # type: ignore[attr-defined]


def test_among_replicas_holding_as_much_the_less_loaded_wins() -> None:
    outstanding = {"replica:2": 2, "replica:3": 1}
    assert pick(outstanding, matches={"replica:2": 9, "replica:3": 9})[:2] == ("replica:3", CACHED)


def test_among_replicas_holding_as_much_one_still_computing_it_goes_last() -> None:
    """A hot prefix just spilled to replica 3: it holds the prefix as the mirrors see it, and
    has the fewest requests, but its first token is a whole prefill away; replica 2 answers
    at once. A difference within HOLDER_WAIT_SLACK_S (a decode step) leaves the less loaded
    first, and the waits are not worked out where one replica holds the longest prefix."""
    outstanding = {"replica:1": 3, "replica:2": 3, "replica:3": 1, "replica:4": 4}
    matches = {"replica:2": 9, "replica:3": 9, "replica:4": 9}
    computing = {"replica:2": 0.004, "replica:3": 0.150, "replica:4": 0.004}
    assert pick(outstanding, matches=matches, starts=computing) == ("replica:2", CACHED, 9)
    alike = {"replica:2": 0.004, "replica:3": 0.004 + HOLDER_WAIT_SLACK_S / 2, "replica:4": 0.004}
    assert pick(outstanding, matches=matches, starts=alike) == ("replica:3", CACHED, 9)
    # Hot, and the holders that answer at once past the mean: the one computing it, which
    # holds it too, before a replica that would compute it again (a whole prefill, later).
    crowded = {"replica:1": 0, "replica:2": 9, "replica:3": 1, "replica:4": 8}
    again = {**computing, "replica:1": 0.155}
    got = pick(crowded, matches=matches, starts=again, hot=True)
    assert got == ("replica:3", SPILLED, 9)

    def never() -> dict[str, float]:
        raise AssertionError("the waits were worked out for nothing")

    one = choose_cached(
        FOUR,
        outstanding,
        {},
        0.0,
        placement=Placement(7, None, {"replica:2": 9, "replica:3": 4}),
        bounds=BOUNDS,
        starts=never,
    )
    assert one is not None and one.upstream.id == "replica:2"


def test_a_hot_prefix_goes_where_its_first_token_comes_much_sooner_among_those_under_bound() -> (
    None
):
    """No one replica can serve a hot prefix, so it is spread at the mean, and of the replicas
    under the bound it goes where it is answered much sooner: not behind a replica that is
    still computing it with requests already queued there (they wait out its whole prefill and
    each other's), when an idle one would compute it sooner. Within HOLDER_WAIT_SLACK_S the
    order stands (the prefix kept where it is cached)."""
    matches = {"replica:2": 9, "replica:3": 9}
    crowded = {"replica:1": 0, "replica:2": 9, "replica:3": 2, "replica:4": 8}
    queued = {"replica:1": 0.155, "replica:2": 0.004, "replica:3": 0.170, "replica:4": 0.020}
    assert pick(crowded, matches=matches, starts=queued, hot=True) == ("replica:1", SPILLED, 0)
    close = {**queued, "replica:3": 0.155 + HOLDER_WAIT_SLACK_S / 2}
    assert pick(crowded, matches=matches, starts=close, hot=True) == ("replica:3", SPILLED, 9)
    # Not hot: kept where it is cached, the next holder in order once the first is past the
    # bound, whatever the waits.
    assert pick(crowded, matches=matches, starts=queued) == ("replica:3", SPILLED, 9)
    # The waits are worked out once for both rules (the holders' order, then the hot bound).
    reads: list[int] = []

    def waits() -> dict[str, float]:
        reads.append(1)
        return queued

    got = choose_cached(
        FOUR,
        crowded,
        {},
        0.0,
        placement=Placement(7, None, matches, True),
        bounds=BOUNDS,
        starts=waits,
    )
    assert got is not None and got.upstream.id == "replica:1" and reads == [1]


def test_a_replica_past_the_bound_spills_to_the_best_of_the_others() -> None:
    # Ten in flight: the bound is ceil(1.25 * 11 / 4) = 4, and replica 3 has 4.
    outstanding = {"replica:1": 3, "replica:2": 2, "replica:3": 4, "replica:4": 1}
    got = pick(outstanding, matches={"replica:3": 9, "replica:1": 5})
    assert got == ("replica:1", SPILLED, 5)


def test_a_prefix_nobody_holds_goes_where_its_first_block_ranks_first_in_every_process() -> None:
    for lead in range(50):
        assert pick(lead=lead) == (first_for(lead), COLD, 0)


def test_new_prefixes_spread_over_the_replicas_by_their_first_blocks() -> None:
    counts = Counter(first_for(random.Random(i).getrandbits(32)) for i in range(4000))
    assert set(counts) == {u.id for u in FOUR}
    assert max(counts.values()) < 1.15 * min(counts.values())


def test_a_cold_prefix_spills_in_its_own_rendezvous_order() -> None:
    lead = 12345
    order = [u.id for u in rendezvous(lead, FOUR)]
    outstanding = {order[0]: 5, order[1]: 0, order[2]: 0, order[3]: 0}
    assert pick(outstanding, lead=lead) == (order[1], SPILLED, 0)


def test_a_cold_prefix_takes_its_order_among_those_within_the_cold_slack_of_the_least_loaded() -> (
    None
):
    lead = 12345
    order = [u.id for u in rendezvous(lead, FOUR)]
    # Slack 2: its first may have two more than the least loaded...
    assert pick({order[0]: 3, order[1]: 1, order[2]: 1, order[3]: 1}, lead=lead)[:2] == (
        order[0],
        COLD,
    )
    # ...not three; then the next in its order that may.
    outstanding = {order[0]: 4, order[1]: 5, order[2]: 2, order[3]: 1}
    assert pick(outstanding, lead=lead) == (order[2], SPILLED, 0)


def test_a_cold_prefix_goes_where_its_first_token_would_come_soonest() -> None:
    """A new prompt waits behind the prefill queued where it goes, not behind what decodes:
    the soonest first token first, outstanding within the slack among those."""
    lead = 12345
    order = [u.id for u in rendezvous(lead, FOUR)]
    outstanding = {order[0]: 1, order[1]: 1, order[2]: 9, order[3]: 12}
    starts = {order[0]: 0.12, order[1]: 0.4, order[2]: 0.1, order[3]: 0.1}
    assert pick(outstanding, lead=lead, starts=starts) == (order[2], SPILLED, 0)
    # Equal queues: its own order, within the slack of the least outstanding.
    assert pick(outstanding, lead=lead, starts={})[:2] == (order[0], COLD)
    # The soonest wins however little sooner: the queue's end is where it starts.
    starts = {order[0]: 0.111, order[1]: 0.110, order[2]: 0.5, order[3]: 0.2}
    assert pick({}, lead=lead, starts=starts) == (order[1], SPILLED, 0)


def test_a_small_shared_part_is_weighed_against_the_queues_not_followed() -> None:
    """Prompts that open with one short preamble and go on apart (a document each) are
    predicted cached for that preamble where the first went: a small share of each. Piled
    there for it, they would wait behind each other longer than the preamble saves, so they
    go where their first token comes soonest, the preamble's time saved counted."""
    lead = 12345
    order = [u.id for u in rendezvous(lead, FOUR)]
    matches = {order[3]: 1}
    busy = {order[0]: 0.3, order[1]: 0.3, order[2]: 0.3, order[3]: 0.5}
    assert pick({}, lead=lead, matches=matches, share=0.08, starts=busy)[:2] == (order[0], COLD)
    # Where it saves the most, it goes there: its predicted blocks said.
    level = {order[0]: 0.3, order[1]: 0.3, order[2]: 0.3, order[3]: 0.28}
    assert pick({}, lead=lead, matches=matches, share=0.08, starts=level) == (order[3], CACHED, 1)
    # Half the prompt or more cached: kept there, whatever the queues say (within the bound).
    assert pick({}, lead=lead, matches=matches, share=0.6, starts=busy) == (order[3], CACHED, 1)


def test_a_choice_says_when_it_placed_a_prefix_nobody_held() -> None:
    lead = 12345
    assert choose_cached(FOUR, {}, {}, 0.0, placement=Placement(lead), bounds=BOUNDS).placed  # type: ignore[union-attr]
    held = Placement(lead, matches={"replica:2": 3})
    assert not choose_cached(FOUR, {}, {}, 0.0, placement=held, bounds=BOUNDS).placed  # type: ignore[union-attr]


def test_a_session_sticks_to_one_replica_whatever_is_cached_elsewhere() -> None:
    key = session_key("conversation-42")
    home = first_for(key)
    elsewhere = next(u.id for u in FOUR if u.id != home)
    assert pick(affinity=key, matches={elsewhere: 20}) == (home, AFFINITY, 0)


def test_a_session_leaves_its_replica_only_past_the_bound() -> None:
    key = session_key("conversation-42")
    order = [u.id for u in rendezvous(key, FOUR)]
    assert pick({order[0]: 1}, affinity=key)[:2] == (order[0], AFFINITY)  # slack 2 allows it
    assert pick({order[0]: 6, order[1]: 1}, affinity=key)[:2] == (order[1], SPILLED)


def test_without_a_prompt_block_the_least_loaded_takes_it() -> None:
    outstanding = {"replica:1": 2, "replica:2": 1, "replica:3": 0, "replica:4": 3}
    assert pick(outstanding, lead=None) == ("replica:3", LEAST_LOADED, 0)


def test_ejected_and_tried_replicas_are_passed_over() -> None:
    assert pick(matches={"replica:1": 9}, ejected={"replica:1": 10.0})[0] != "replica:1"
    assert pick(matches={"replica:1": 9}, exclude=("replica:1",))[0] != "replica:1"
    all_ejected = {u.id: 10.0 for u in FOUR}
    assert pick(matches={"replica:2": 9}, ejected=all_ejected)[:2] == ("replica:2", CACHED)
    assert (
        choose_cached(
            FOUR, {}, {}, 0.0, placement=Placement(1), bounds=BOUNDS, exclude=[u.id for u in FOUR]
        )
        is None
    )


def test_one_hot_prefix_spreads_within_the_bound_of_the_mean() -> None:
    # 200 requests of one prefix in flight at once: none of the four holds more than the bound.
    outstanding: dict[str, int] = {}
    held: dict[str, int] = {}
    for _ in range(200):
        uid, _, _ = pick(outstanding, matches=held)
        outstanding[uid] = outstanding.get(uid, 0) + 1
        held[uid] = 9
    assert max(outstanding.values()) <= 1.25 * 200 / 4 + 1


def test_weights_share_the_bound_and_the_rendezvous_order() -> None:
    heavy = Upstream("endpoint:big", "http://big", weight=3)
    light = Upstream("endpoint:small", "http://small", weight=1)
    leads = Counter(rendezvous(i * 7919, (heavy, light))[0].id for i in range(4000))
    assert 2.5 < leads["endpoint:big"] / leads["endpoint:small"] < 3.5


def test_a_cool_prefix_stays_where_it_is_cached_up_to_the_slack_a_hot_one_does_not() -> None:
    loose = Bounds(factor=1.25, slack=16, cold_slack=2)
    # Twelve in flight, eight of them on replica 1, which holds the prefix: the mean bound
    # (ceil(1.25 * 13 / 4) = 5) is passed, the slack of 16 is not.
    outstanding = {"replica:1": 8, "replica:2": 2, "replica:3": 1, "replica:4": 1}
    held = {"replica:1": 9}
    assert pick(outstanding, matches=held, bounds=loose)[:2] == ("replica:1", CACHED)
    assert pick(outstanding, matches=held, bounds=loose, hot=True)[:2] != ("replica:1", CACHED)
    assert pick(outstanding, matches=held, bounds=loose, hot=True)[1] == SPILLED


def test_a_key_is_hot_past_one_upstreams_share_of_what_is_in_flight_not_by_chance() -> None:
    # A burst's first requests: eight prefixes drawn at random, so some of them are more than
    # a quarter of the first few by chance. None is more than one upstream of four can serve:
    # none is hot.
    for seed in range(20):
        burst = Loads()
        for key in random.Random(seed).choices(range(8), k=64):
            assert not burst.hot(key, 4), seed
            burst.acquire("r1", 0, 0.0, key)
    # One prefix taking every request is hot within a few.
    loads = Loads()
    taken = 0
    while not loads.hot(99, 4):
        loads.acquire("r1", 0, 0.0, 99)
        taken += 1
    assert taken <= 6
    # Twenty-four at once of one prefix, after fifty of others that are done: hot.
    after = Loads()
    for key in range(50):
        after.release(after.acquire("r1", 0, 0.0, key))
    held = [after.acquire("r1", 0, 0.0, 7) for _ in range(23)]
    assert after.hot(7, 3)
    # A prefix counts while its requests are held, and no longer after.
    for hold in held:
        after.release(hold)
    assert after.in_flight == {} and after.flying == 0
