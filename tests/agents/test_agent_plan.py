"""The agent's decisions are pure: a desired state and what runs in, actions out; tested by
table without a process, a file or a clock. So are the weights janitor's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agents.plan import (
    Action,
    Drain,
    Forget,
    NodeFacts,
    RecordStopped,
    Refuse,
    RunningShard,
    Start,
    Stop,
    Update,
    Wait,
    Want,
    escalates,
    fingerprint,
    plan,
    refusal,
)
from agents.protocol.messages import DesiredShard, DesiredState, WeightsReport
from agents.protocol.vocabulary import DesiredShardState, Engine, ShardState, WeightsState
from agents.weights import judge, weights_users

NODE = NodeFacts(port_range=(20000, 20009), gpus=frozenset({0, 1}))
RUNNING, DRAINING, STOPPED = (
    DesiredShardState.RUNNING,
    DesiredShardState.DRAINING,
    DesiredShardState.STOPPED,
)


def shard(shard_id: int = 1, state: DesiredShardState = RUNNING, **changes: object) -> DesiredShard:
    spec = DesiredShard(
        shard_id=shard_id,
        replica_id=shard_id,
        generation=1,
        state=state,
        engine=Engine.SIM,
        model=f"m{shard_id}",
        source="org/m",
        port=20000 + shard_id,
        gpu_indices=(0,),
    )
    return replace(spec, **changes)  # type: ignore[arg-type]


def runs(
    spec: DesiredShard,
    state: ShardState = ShardState.READY,
    want: Want = Want.RUN,
    *,
    finished: bool | None = None,
) -> RunningShard:
    """What the supervisor knows of ``spec``'s incarnation; finished by default when its state
    says so (its lifecycle task has ended)."""
    done = state in (ShardState.STOPPED, ShardState.FAILED) if finished is None else finished
    return RunningShard(spec, fingerprint(spec), state, want, done)


def desired(*shards: DesiredShard) -> DesiredState:
    return DesiredState(node="n1", epoch=1, revision=1, shards=shards)


def decide(wanted: tuple[DesiredShard, ...], *running: RunningShard) -> list[Action]:
    return plan(desired(*wanted), {rt.spec.shard_id: rt for rt in running}, NODE)


A = shard(1)
FP = fingerprint(A)
NEW_GENERATION = replace(A, generation=2)
SLOWER_START = replace(A, startup_timeout_s=900.0)
A_DRAINS = replace(A, state=DRAINING)
A_STOPS = replace(A, state=STOPPED)


@pytest.mark.parametrize(
    ("wanted", "running", "expected"),
    [
        # Running is wanted.
        ((A,), (), [Start(A, FP)]),
        ((A,), (runs(A, ShardState.STARTING),), []),
        ((A,), (runs(A),), []),
        ((SLOWER_START,), (runs(A),), [Update(SLOWER_START)]),
        ((NEW_GENERATION,), (runs(A),), [Stop(1, "changed: restarting it")]),
        ((NEW_GENERATION,), (runs(A, want=Want.STOP),), []),
        ((A,), (runs(A, ShardState.STOPPED),), [Start(A, FP)]),
        ((A,), (runs(A, ShardState.FAILED),), []),
        ((NEW_GENERATION,), (runs(A, ShardState.FAILED),),
         [Start(NEW_GENERATION, fingerprint(NEW_GENERATION))]),
        # A failure noticed but its lifecycle not yet over: wait for it, start nothing beside.
        ((NEW_GENERATION,), (runs(A, ShardState.FAILED, finished=False),),
         [Stop(1, "changed: restarting it")]),
        # Draining is wanted (the desired state is part of the spec, taken in place).
        ((A_DRAINS,), (), [RecordStopped(A_DRAINS, FP)]),
        ((A_DRAINS,), (runs(A),), [Update(A_DRAINS), Drain(1)]),
        ((A_DRAINS,), (runs(A_DRAINS, ShardState.DRAINING, Want.DRAIN),), []),
        ((A_DRAINS,), (runs(A_DRAINS, want=Want.STOP),), []),
        ((A_DRAINS,), (runs(A_DRAINS, ShardState.STOPPED),), []),
        # Stopped is wanted.
        ((A_STOPS,), (), [RecordStopped(A_STOPS, FP)]),
        ((A_STOPS,), (runs(A),), [Update(A_STOPS), Stop(1)]),
        ((A_STOPS,), (runs(A_DRAINS, ShardState.DRAINING, Want.DRAIN),),
         [Update(A_STOPS), Stop(1)]),
        ((A_STOPS,), (runs(A_STOPS, ShardState.STOPPED),), []),
        # Waiting to start (for a GPU or port), then asked to drain or stop: simply stopped.
        ((A_DRAINS,), (runs(A, ShardState.PENDING, finished=True),),
         [Update(A_DRAINS), RecordStopped(A_DRAINS, FP)]),
        ((A_STOPS,), (runs(A, ShardState.PENDING, finished=True),),
         [Update(A_STOPS), RecordStopped(A_STOPS, FP)]),
        # Not wanted at all.
        ((), (runs(A, ShardState.PENDING, finished=True),), [Forget(1)]),
        ((), (runs(A),), [Stop(1, "is not in the desired state: stopping it")]),
        ((), (runs(A, want=Want.STOP),), []),
        ((), (runs(A, ShardState.STOPPED),), [Forget(1)]),
        ((), (runs(A, ShardState.FAILED),), [Forget(1)]),
    ],
)  # fmt: skip
def test_the_plan_converges_each_shard_by_table(
    wanted: tuple[DesiredShard, ...], running: tuple[RunningShard, ...], expected: list[Action]
) -> None:
    assert decide(wanted, *running) == expected


def test_nothing_is_stopped_before_the_control_plane_has_spoken() -> None:
    assert plan(None, {1: runs(A)}, NODE) == []


def test_a_snapshot_applied_to_what_it_started_plans_nothing() -> None:
    wanted = (shard(1), shard(2, DRAINING), shard(3, STOPPED))
    first = decide(wanted)
    assert [type(a) for a in first] == [Start, RecordStopped, RecordStopped]
    after = [runs(wanted[0], ShardState.STARTING)] + [
        runs(s, ShardState.STOPPED) for s in wanted[1:]
    ]
    assert decide(wanted, *after) == []


def test_wanted_shards_come_first_then_the_ones_to_forget_or_stop() -> None:
    gone, stale = shard(5), shard(6, gpu_indices=(1,))
    actions = decide((A,), runs(gone, ShardState.STOPPED), runs(stale))
    assert actions == [Start(A, FP), Forget(5), Stop(6, "is not in the desired state: stopping it")]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (shard(1, port=80), "port 80 is outside this agent's port range 20000-20009"),
        (shard(1, port=20010), "port 20010 is outside this agent's port range 20000-20009"),
        (shard(1, gpu_indices=(1, 7)), "GPU(s) [7] do not exist on this node (it has 0,1)"),
        (shard(1, port=20000), ""),
        (shard(1, port=20009, gpu_indices=(0, 1)), ""),
        (shard(1, gpu_indices=()), ""),
    ],
)
def test_a_shard_this_node_cannot_run_is_refused_with_the_reason(
    spec: DesiredShard, reason: str
) -> None:
    assert refusal(spec, NODE, {}, {}) == reason
    expected: Action = (
        Refuse(spec, fingerprint(spec), reason) if reason else Start(spec, fingerprint(spec))
    )
    assert decide((spec,)) == [expected]


def test_no_gpu_at_all_is_said_plainly() -> None:
    assert refusal(shard(1), replace(NODE, gpus=frozenset()), {}, {}) == (
        "GPU(s) [0] do not exist on this node (it has none)"
    )


def test_a_port_held_by_a_live_shard_is_refused_and_a_finished_ones_port_is_free() -> None:
    holder = shard(2, port=20001)
    reason = "port 20001 is already used by shard 2"
    assert decide((A, holder), runs(holder)) == [Refuse(A, FP, reason)]
    assert decide((A, holder), runs(holder, want=Want.STOP)) == [Refuse(A, FP, reason)]
    assert decide((A,), runs(holder, ShardState.STOPPED)) == [Start(A, FP), Forget(2)]
    # A shard restarting on its own port does not collide with its old incarnation.
    assert decide((NEW_GENERATION,), runs(A, ShardState.STOPPED))[0] == Start(
        NEW_GENERATION, fingerprint(NEW_GENERATION)
    )


def test_two_new_shards_on_one_port_start_once_but_a_refused_one_holds_nothing() -> None:
    first, second = shard(1, port=20005), shard(2, port=20005)
    assert decide((first, second)) == [
        Start(first, fingerprint(first)),
        Refuse(second, fingerprint(second), "port 20005 is already used by shard 1"),
    ]
    no_gpu = shard(1, port=20005, gpu_indices=(9,))
    actions = decide((no_gpu, second))
    assert [type(a) for a in actions] == [Refuse, Start]


def test_a_gpu_held_by_a_shard_wanted_running_is_refused_with_its_holder() -> None:
    holder = shard(2, gpu_indices=(1, 0))
    reason = "GPU(s) [0] already used by shard(s) [2]"
    assert decide((A, holder), runs(holder)) == [Refuse(A, FP, reason)]
    assert decide((A, holder), runs(holder, ShardState.STARTING)) == [Refuse(A, FP, reason)]
    both = shard(3, gpu_indices=(0, 1))
    assert refusal(both, NODE, {}, {0: 2, 1: 2}) == "GPU(s) [0, 1] already used by shard(s) [2]"
    # Two new shards on one GPU: the first starts, the second is refused.
    first, second = shard(1, gpu_indices=(1,)), shard(2, gpu_indices=(1,))
    assert decide((first, second)) == [
        Start(first, fingerprint(first)),
        Refuse(second, fingerprint(second), "GPU(s) [1] already used by shard(s) [1]"),
    ]


LEFT_RUNNING = shard(5, port=A.port)  # A's GPU and port, a replica the control plane stopped


@pytest.mark.parametrize(
    "leaving",
    [
        # Not in the desired state: a node back from being lost still runs it.
        ((), runs(LEFT_RUNNING, ShardState.STARTING)),
        ((), runs(LEFT_RUNNING, want=Want.STOP)),
        # Wanted drained or stopped, the process not yet ended.
        ((replace(LEFT_RUNNING, state=DRAINING),), runs(LEFT_RUNNING, ShardState.DRAINING)),
        ((replace(LEFT_RUNNING, state=STOPPED),), runs(LEFT_RUNNING, want=Want.STOP)),
        # Wanted running again but changed: its old incarnation stops first.
        ((replace(LEFT_RUNNING, generation=2),), runs(LEFT_RUNNING, want=Want.STOP)),
    ],
)
def test_a_shard_waits_for_the_gpu_and_port_of_one_on_its_way_out_then_starts(
    leaving: tuple[tuple[DesiredShard, ...], RunningShard],
) -> None:
    also_wanted, old = leaving
    waiting = decide((A, *also_wanted), old)
    assert waiting[0] == Wait(
        A,
        FP,
        "waiting for stopping shards to free port 20001 (shard 5) and GPU(s) [0] (shard(s) [5])",
    )
    assert not [a for a in waiting if isinstance(a, Start)]
    # Its process has ended: the next plan (the supervisor plans when a shard's life ends)
    # starts the new one.
    ended = RunningShard(old.spec, old.fingerprint, ShardState.STOPPED, old.want, True)
    assert decide((A, *also_wanted), ended)[0] == Start(A, FP)


def test_only_a_port_or_gpu_a_leaving_shard_holds_makes_a_shard_wait() -> None:
    old = runs(shard(5, gpu_indices=(1,), port=20008))
    assert decide((A,), old)[0] == Start(A, FP)
    only_gpu = runs(shard(5, port=20008))
    assert decide((A,), only_gpu)[0] == Wait(
        A, FP, "waiting for stopping shards to free GPU(s) [0] (shard(s) [5])"
    )


@pytest.mark.parametrize(
    ("current", "wanted", "expected"),
    [
        (Want.RUN, Want.DRAIN, True),
        (Want.RUN, Want.STOP, True),
        (Want.DRAIN, Want.STOP, True),
        (Want.DRAIN, Want.RUN, False),
        (Want.STOP, Want.DRAIN, False),
        (Want.STOP, Want.STOP, False),
    ],
)
def test_requests_only_escalate(current: Want, wanted: Want, expected: bool) -> None:
    assert escalates(current, wanted) is expected


# --------------------------------------------------------------------------- weights

ROOT = Path("/srv/w")
REMOVED = WeightsReport("org/m", WeightsState.REMOVED, "/srv/w/org/m")


@pytest.mark.parametrize(
    ("target", "exists", "users", "previous", "expected"),
    [
        (None, False, [], None,
         WeightsReport("org/m", WeightsState.REFUSED, "outside the weights directory")),
        (ROOT / "org/m", False, [], None,
         WeightsReport("org/m", WeightsState.ABSENT, "not on this node")),
        (ROOT / "org/m", False, [], REMOVED, REMOVED),
        (ROOT / "org/m", True, [3, 4], None,
         WeightsReport("org/m", WeightsState.REFUSED,
                       "refused: in use by shard(s) 3, 4; they must stop before their weights "
                       "are removed")),
        (ROOT / "org/m", True, [], REMOVED, None),
        (ROOT / "org/m", True, [], None, None),
    ],
)  # fmt: skip
def test_the_janitor_judges_each_name_by_table(
    target: Path | None,
    exists: bool,
    users: list[int],
    previous: WeightsReport | None,
    expected: WeightsReport | None,
) -> None:
    assert judge("org/m", target, exists=exists, users=users, previous=previous) == expected


def test_weights_are_in_use_by_shards_whose_source_lies_in_or_holds_them() -> None:
    specs = [
        shard(1, source="org/m"),
        shard(2, source="org/m/sub"),
        shard(3, source="org"),
        shard(4, source="org/other"),
        shard(5, source="/elsewhere/org/m"),
    ]
    assert weights_users(ROOT / "org" / "m", ROOT, specs) == [1, 2, 3]
