"""The reconciler against the store: placement, activation, restart with backoff, lost nodes,
drains, idle scale-down and eviction, all fenced. Agents are not running here; where a test
needs an agent's report it writes the observed state the agent would have written."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from control import gateway_counts, leases, serving, tasks
from control.desired_state import build_desired_state
from control.leader_operations import change_desired
from control.models import Event, Node, ProfileScale, Replica, ServedModel, Shard
from control.reconciler.runner import Reconciler, process_reconciler
from control.reconciler.tick import TickResult, models_in_turn, tick
from tests.harness.factories import gib, make_model, make_node, make_profile
from tests.harness.store import unreachable_store

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("election_on")]


@pytest.fixture
def lead() -> leases.Leadership:
    return leases.claim(owner="leader", ttl=60, renew_deadline=40)


def run_tick(
    lead: leases.Leadership, now: datetime | None = None, *, agents_alive: bool = True
) -> TickResult:
    """A tick at ``now``; by default every node's agent has just sent a heartbeat."""
    now = now or timezone.now()
    if agents_alive:
        Node.objects.update(last_heartbeat_at=now)
    return tick(lead, now)


def running(model: ServedModel) -> list[Replica]:
    return list(model.replicas.filter(desired=Replica.Desired.RUNNING).order_by("id"))


def set_observed(replica: Replica, state: str, **fields: Any) -> None:
    """What the agents' reports would have written."""
    Shard.objects.filter(replica=replica).update(observed=state)
    Replica.objects.filter(pk=replica.pk).update(observed=state, **fields)


def test_minimum_replicas_are_placed_on_distinct_gpus_and_a_second_tick_changes_nothing(
    lead: leases.Leadership,
) -> None:
    node = make_node("a", gpus=gib(80, 80, 80))
    model = make_model("m", min_replicas=2, max_replicas=2)
    result = run_tick(lead)
    assert result.placed == 2
    shards = list(Shard.objects.filter(replica__model=model))
    assert [s.node_id for s in shards] == [node.pk, node.pk]
    assert len({tuple(s.gpu_indices) for s in shards}) == 2
    assert len({s.port for s in shards}) == 2
    assert all(r.epoch == lead.epoch for r in running(model))
    revision = Node.objects.get(pk=node.pk).desired_revision
    assert revision >= 1, "the node's desired state changed"

    again = run_tick(lead)
    assert (again.placed, again.changed) == (0, 0)
    assert Node.objects.get(pk=node.pk).desired_revision == revision


def test_a_tick_past_its_budget_leaves_the_next_models_to_the_next_tick(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80, 80, 80, 80))
    models = [make_model(f"m{i}", min_replicas=1) for i in range(3)]
    now = timezone.now()
    Node.objects.update(last_heartbeat_at=now)
    # No time at all: each tick scales one model, then says where the next one goes on.
    first = tick(lead, now, budget=0.0)
    assert first.placed == 1 and first.resume_after == models[0].pk
    second = tick(lead, now, budget=0.0, resume_after=first.resume_after)
    assert second.placed == 1 and second.resume_after == models[1].pk
    third = tick(lead, now, budget=0.0, resume_after=second.resume_after)
    assert third.placed == 1 and third.resume_after == models[2].pk
    assert all(len(running(m)) == 1 for m in models)
    # Each of those placed and stopped on its budget: the next tick is wanted at once.
    assert first.more_to_place and second.more_to_place and third.more_to_place
    # Out of budget with nothing placed (a steady fleet) is no reason to tick again early...
    idle = tick(lead, now, budget=0.0, resume_after=third.resume_after)
    assert idle.placed == 0 and idle.resume_after is not None and not idle.more_to_place
    # ...and a generous budget goes round every model and leaves nothing over.
    last = tick(lead, now, budget=60.0, resume_after=third.resume_after)
    assert (last.placed, last.resume_after, last.more_to_place) == (0, None, False)


def test_models_take_turns_after_the_one_a_tick_stopped_at() -> None:
    models = [ServedModel(pk=pk, name=f"m{pk}") for pk in (5, 1, 3, 9)]
    turn = models_in_turn
    assert [m.pk for m in turn(models, None)] == [1, 3, 5, 9]
    assert [m.pk for m in turn(models, 3)] == [5, 9, 1, 3]
    assert [m.pk for m in turn(models, 9)] == [1, 3, 5, 9]
    assert [m.pk for m in turn(models, 4)] == [5, 9, 1, 3]


def test_nodes_are_placed_on_by_their_labels_and_malformed_json_columns_read_as_empty(
    lead: leases.Leadership,
) -> None:
    """The tick reads nodes' JSON columns as text and decodes them only where it needs them.
    Values of the wrong shape (whatever wrote them) read as empty: that node has no labels
    and no weights, and the tick places as usual."""
    make_node("odd", labels=["not", "a", "mapping"], weights_report={"not": "a list"})
    Node.objects.filter(name="odd").update(remove_weights="org/x")
    labelled = make_node("pool-a", labels={"pool": "a"})
    make_node("plain")
    picky = make_model("picky", min_replicas=1, max_replicas=1)
    picky.default_profile.gpu_selector = {"pool": "a"}
    picky.default_profile.save()
    anywhere = make_model("anywhere", min_replicas=2, max_replicas=2)
    assert run_tick(lead).placed == 3
    assert [s.node_id for s in Shard.objects.filter(replica__model=picky)] == [labelled.pk]
    assert Shard.objects.filter(replica__model=anywhere).count() == 2
    assert Node.objects.get(name="odd").remove_weights == "org/x", "not a list: left alone"


def test_a_cold_model_gets_a_replica_only_when_a_request_waits(lead: leases.Leadership) -> None:
    make_node("a", gpus=gib(80))
    model = make_model("cold")
    run_tick(lead)
    assert running(model) == []
    ServedModel.objects.filter(pk=model.pk).update(demand_at=timezone.now())
    assert run_tick(lead).placed == 1
    assert len(running(model)) == 1


def test_an_unplaceable_replica_records_why_once(lead: leases.Leadership) -> None:
    make_node("gpu-3", gpus=gib(80))
    model = make_model("big", gpus=2, memory_gib=80, min_replicas=1)
    run_tick(lead)
    run_tick(lead)
    model.refresh_from_db()
    assert model.placement_note == "needs 2×80 GiB on one node; largest free is 1×80 GiB on gpu-3"
    assert Event.objects.filter(message__startswith="cannot place").count() == 1


def test_a_failed_replica_restarts_after_its_backoff_with_a_new_generation(
    lead: leases.Leadership, settings: Any
) -> None:
    settings.LLMGW_BACKOFF_BASE = 2.0
    make_node("a", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    run_tick(lead)
    (replica,) = running(model)
    set_observed(replica, Replica.Observed.FAILED, failures=1, failure_class="crash")
    now = timezone.now()
    run_tick(lead, now)
    replica.refresh_from_db()
    assert replica.backoff_until == now + timedelta(seconds=2)
    assert replica.generation == 1

    run_tick(lead, now + timedelta(seconds=1))
    replica.refresh_from_db()
    assert replica.generation == 1, "not before the backoff ends"

    run_tick(lead, now + timedelta(seconds=2.5))
    replica.refresh_from_db()
    assert (replica.generation, replica.observed) == (2, "pending")
    assert replica.backoff_until is None
    assert replica.failures == 1, "the failure count is kept until it is ready again"
    assert len(running(model)) == 1, "restarted in place, not replaced"

    set_observed(replica, Replica.Observed.FAILED, failures=2)
    later = now + timedelta(seconds=3)
    run_tick(lead, later)
    replica.refresh_from_db()
    assert replica.backoff_until == later + timedelta(seconds=4), "the backoff doubles"


def test_replicas_on_a_lost_node_are_stopped_and_placed_elsewhere(
    lead: leases.Leadership, settings: Any
) -> None:
    a = make_node("a", gpus=gib(80))
    b = make_node("b", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    Node.objects.filter(pk=b.pk).update(schedule=Node.Schedule.CORDONED)
    run_tick(lead)
    (first,) = running(model)
    assert first.shards.get().node_id == a.pk
    Node.objects.filter(pk=b.pk).update(schedule=Node.Schedule.ACTIVE)

    lost_at = timezone.now() + timedelta(seconds=settings.LLMGW_LOST_AFTER + 1)
    Node.objects.filter(pk=b.pk).update(last_heartbeat_at=lost_at)
    run_tick(lead, lost_at, agents_alive=False)
    assert Node.objects.get(pk=a.pk).health == Node.Health.LOST
    first.refresh_from_db()
    assert first.desired == Replica.Desired.STOPPED
    (replacement,) = running(model)
    assert replacement.shards.get().node_id == b.pk


def test_draining_a_node_places_a_replacement_before_draining_the_old_replica(
    lead: leases.Leadership,
) -> None:
    a = make_node("a", gpus=gib(80))
    make_node("b", gpus=gib(80))
    model = make_model("m", min_replicas=1, idle_timeout_s=3600)
    Node.objects.filter(name="b").update(schedule=Node.Schedule.CORDONED)
    run_tick(lead)
    (old,) = running(model)
    set_observed(old, Replica.Observed.READY)
    Node.objects.filter(name="b").update(schedule=Node.Schedule.ACTIVE)
    Node.objects.filter(pk=a.pk).update(schedule=Node.Schedule.DRAINING)

    run_tick(lead)
    old.refresh_from_db()
    assert old.desired == Replica.Desired.RUNNING, "keeps serving until the replacement is ready"
    new = model.replicas.exclude(pk=old.pk).get()
    assert new.shards.get().node.name == "b"

    set_observed(new, Replica.Observed.READY)
    run_tick(lead)
    old.refresh_from_db()
    assert old.desired == Replica.Desired.DRAINING

    set_observed(old, Replica.Observed.STOPPED)
    run_tick(lead)
    old.refresh_from_db()
    assert old.desired == Replica.Desired.STOPPED


def test_an_idle_model_scales_down_to_its_minimum_draining_ready_replicas(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80, 80))
    now = timezone.now()
    model = make_model(
        "m", max_replicas=2, idle_timeout_s=60, activation_timeout_s=30, demand_at=now
    )
    ServedModel.objects.filter(pk=model.pk).update(min_replicas=2)
    run_tick(lead, now)
    assert len(running(model)) == 2
    for replica in running(model):
        set_observed(replica, Replica.Observed.READY)
    ServedModel.objects.filter(pk=model.pk).update(min_replicas=0, last_request_at=now)

    run_tick(lead, now + timedelta(seconds=30))
    assert len(running(model)) == 2, "busy within its idle timeout"

    run_tick(lead, now + timedelta(seconds=61))
    assert running(model) == []
    assert model.replicas.filter(desired=Replica.Desired.DRAINING).count() == 2


def test_eviction_drains_an_idle_unpinned_replica_to_make_room_for_waiting_demand(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80))
    now = timezone.now()
    old = make_model("old", idle_timeout_s=3600, demand_at=now, last_request_at=now)
    run_tick(lead, now)
    (victim,) = running(old)
    set_observed(victim, Replica.Observed.READY)

    hot = make_model("hot", demand_at=now)
    run_tick(lead, now)
    victim.refresh_from_db()
    assert victim.desired == Replica.Desired.DRAINING
    assert running(hot) == [], "its GPU is not free until the drain completes"

    set_observed(victim, Replica.Observed.STOPPED)
    run_tick(lead, now)
    assert len(running(hot)) == 1
    assert Event.objects.filter(message__contains="evicted (idle) to make room for hot").exists()


def test_pinned_replicas_and_replicas_serving_requests_are_not_evicted(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80, 80))
    now = timezone.now()
    pinned = make_model("pinned", pinned=True, demand_at=now, last_request_at=now)
    serving = make_model("serving", demand_at=now, last_request_at=now, idle_timeout_s=3600)
    run_tick(lead, now)
    set_observed(running(pinned)[0], Replica.Observed.READY)
    set_observed(running(serving)[0], Replica.Observed.READY)
    Shard.objects.filter(replica__model=serving).update(requests_running=3)

    hot = make_model("hot", demand_at=now)
    run_tick(lead, now)
    assert len(running(pinned)) == len(running(serving)) == 1
    assert running(hot) == []
    hot.refresh_from_db()
    assert hot.placement_note.startswith("needs 1 GPU on one node")


def test_a_replica_with_a_request_in_flight_at_the_gateway_is_not_scaled_down(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80))
    now = timezone.now()
    model = make_model("m", idle_timeout_s=60, demand_at=now, last_request_at=now)
    run_tick(lead, now)
    (replica,) = running(model)
    set_observed(replica, Replica.Observed.READY)
    gateway_counts.report_in_flight("web-1", {replica.pk: 1})  # a long stream, still going

    later = now + timedelta(minutes=10)
    run_tick(lead, later)
    assert running(model) == [replica], "never scaled down under a request"

    gateway_counts.report_in_flight("web-1", {})  # it finished...
    serving.record_finished({replica.pk: later})
    run_tick(lead, later + timedelta(seconds=30))
    assert running(model) == [replica], "...and idle time counts from its end"
    run_tick(lead, later + timedelta(seconds=61))
    assert running(model) == []
    replica.refresh_from_db()
    assert replica.desired == Replica.Desired.DRAINING and not replica.drain_held


def test_eviction_takes_the_replica_whose_last_request_finished_longest_ago(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80, 80))
    now = timezone.now()
    first = make_model("first", idle_timeout_s=3600, demand_at=now, last_request_at=now)
    second = make_model("second", idle_timeout_s=3600, demand_at=now, last_request_at=now)
    run_tick(lead, now)
    (older_id,) = [r.pk for r in running(first)]
    (newer_id,) = [r.pk for r in running(second)]
    for replica in [*running(first), *running(second)]:
        set_observed(replica, Replica.Observed.READY)
    # The replica created first was used last: least recently used is the other one, not the
    # lower id.
    serving.record_finished({older_id: now, newer_id: now - timedelta(minutes=5)})

    make_model("hot", demand_at=now)
    run_tick(lead, now)
    drained = set(
        Replica.objects.filter(desired=Replica.Desired.DRAINING).values_list("pk", flat=True)
    )
    assert drained == {newer_id}


def test_a_drain_waits_for_the_gateways_requests_before_reaching_the_agent(
    lead: leases.Leadership, settings: Any
) -> None:
    settings.LLMGW_DRAIN_TIMEOUT = 60.0
    a = make_node("a", gpus=gib(80))
    make_node("b", gpus=gib(80))
    model = make_model("m", min_replicas=1, idle_timeout_s=3600)
    Node.objects.filter(name="b").update(schedule=Node.Schedule.CORDONED)
    run_tick(lead)
    (old,) = running(model)
    set_observed(old, Replica.Observed.READY)
    gateway_counts.report_in_flight("web-1", {old.pk: 2})
    Node.objects.filter(name="b").update(schedule=Node.Schedule.ACTIVE)
    Node.objects.filter(pk=a.pk).update(schedule=Node.Schedule.DRAINING)
    run_tick(lead)
    set_observed(model.replicas.exclude(pk=old.pk).get(), Replica.Observed.READY)
    run_tick(lead)
    old.refresh_from_db()
    assert old.desired == Replica.Desired.DRAINING and old.drain_held

    def sent_to_a() -> str:
        (shard,) = [s for s in build_desired_state(a.pk).shards if s.replica_id == old.pk]
        return str(shard.state)

    assert sent_to_a() == "running", "its agent keeps it serving the requests in flight"
    run_tick(lead)
    assert sent_to_a() == "running"

    gateway_counts.report_in_flight("web-1", {})
    revision = Node.objects.get(pk=a.pk).desired_revision
    run_tick(lead)
    assert sent_to_a() == "draining"
    assert Node.objects.get(pk=a.pk).desired_revision > revision, "its agent hears at once"


def test_a_held_drain_is_let_go_after_the_drain_timeout(
    lead: leases.Leadership, settings: Any
) -> None:
    settings.LLMGW_DRAIN_TIMEOUT = 5.0
    make_node("a", gpus=gib(80))
    now = timezone.now()
    model = make_model("m", min_replicas=1, idle_timeout_s=3600)
    run_tick(lead, now)
    (replica,) = running(model)
    set_observed(replica, Replica.Observed.READY)
    gateway_counts.report_in_flight("web-1", {replica.pk: 1})
    ServedModel.objects.filter(pk=model.pk).update(enabled=False, min_replicas=0)
    run_tick(lead, now)
    assert running(model) == [replica], "disabled, but a request is in flight"
    change_desired(
        lead,
        replica.pk,
        from_states=[Replica.Desired.RUNNING],
        to=Replica.Desired.DRAINING,
        subject="model/m",
        why="test",
    )
    replica.refresh_from_db()
    assert replica.drain_held
    run_tick(lead, timezone.now() + timedelta(seconds=6))
    replica.refresh_from_db()
    assert not replica.drain_held


def test_a_deposed_leaders_tick_writes_nothing() -> None:
    make_node("a", gpus=gib(80))
    make_model("m", min_replicas=1)
    old = leases.claim(owner="old", ttl=0, renew_deadline=30)
    leases.claim(owner="new", ttl=60)
    with pytest.raises(leases.LeadershipLost):
        tick(old, timezone.now())
    assert not Replica.objects.exists()
    assert not Event.objects.filter(kind=Event.Kind.PLACEMENT).exists()


def test_run_once_acts_only_while_leading(settings: Any) -> None:
    make_node("a", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    leases.claim(owner="someone-else", ttl=60)
    follower = Reconciler()
    assert not follower.run_once().acted
    assert running(model) == []
    leases.claim(owner="someone-else", ttl=0)
    result = follower.run_once()
    assert result.acted and result.placed == 1
    follower.shutdown()
    view = leases.read()
    assert view is not None and not view.held, "shutdown released the lease"


def test_a_node_silent_while_the_store_was_away_is_not_lost_when_it_returns() -> None:
    """[L6] The heartbeats of a node that ran through a store outage could not be written:
    once a claim reaches the store again, the node is not lost, nor its replica stopped."""
    make_node("a", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    reconciler = Reconciler()
    assert reconciler.run_once().placed == 1
    # Its last heartbeat written 120 s ago, past lost_after (60 s): then the store went away.
    Node.objects.update(last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    with unreachable_store():
        assert not reconciler.run_once().acted
    assert reconciler.run_once().acted
    assert Node.objects.get().health == Node.Health.READY
    assert len(running(model)) == 1
    reconciler.shutdown()


def test_a_clean_stop_hands_the_lease_to_the_next_control_plane_at_once() -> None:
    make_node("a", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    first = Reconciler()
    assert first.run_once().placed == 1
    epoch = first.leadership.epoch if first.leadership else 0
    first.shutdown()
    # The next control plane leads at its first tick, not after the TTL.
    restarted = Reconciler()
    result = restarted.run_once()
    assert result.acted and result.epoch == epoch + 1
    assert len(running(model)) == 1
    restarted.shutdown()


def test_a_leader_below_an_agents_epoch_moves_above_it_before_acting() -> None:
    """A reset store: its lease starts again at epoch 1, the agent has seen 12."""
    node = make_node("a", gpus=gib(80))
    Node.objects.filter(pk=node.pk).update(agent_epoch=12)
    model = make_model("m", min_replicas=1)
    result = Reconciler().run_once()
    assert result.acted and result.epoch == 13
    view = leases.read()
    assert view is not None and view.epoch == 13
    assert [r.epoch for r in running(model)] == [13]


def test_deleting_a_model_asks_its_nodes_to_remove_its_weights_until_done(
    lead: leases.Leadership,
) -> None:
    a = make_node("a", gpus=gib(80))
    make_node("b", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    make_model("other", min_replicas=0)
    run_tick(lead)
    assert model.replicas.get().shards.get().node_id == a.pk
    model.delete()
    assert Node.objects.get(name="a").remove_weights == ["org/m"]
    assert Node.objects.get(name="b").remove_weights == [], "b never ran it"
    assert Event.objects.filter(message__contains="weights org/m to be removed from a").exists()

    run_tick(lead)
    assert Node.objects.get(name="a").remove_weights == ["org/m"], "kept until the agent reports"
    Node.objects.filter(name="a").update(weights_report=[{"name": "org/m", "state": "removed"}])
    run_tick(lead)
    assert Node.objects.get(name="a").remove_weights == []


def test_a_model_re_added_with_the_same_source_cancels_the_removal(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80))
    model = make_model("m", min_replicas=1)
    run_tick(lead)
    model.delete()
    assert Node.objects.get(name="a").remove_weights == ["org/m"]
    make_model("m2", source="org/m")
    run_tick(lead)
    assert Node.objects.get(name="a").remove_weights == []


def test_a_model_runs_under_another_profile_with_its_own_settings_and_counts(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80, 80, 80))
    model = make_model("m", min_replicas=1, idle_timeout_s=3600)
    wide = make_profile("wide", gpus_per_shard=2)
    model.profiles.add(wide)
    run_tick(lead)
    (default,) = running(model)
    assert default.profile_id == model.default_profile_id, "no demand under wide yet"

    serving.record_profile_demand([(model.pk, "wide")])
    run_tick(lead)
    (under_wide,) = [r for r in running(model) if r.profile_id == wide.pk]
    assert len(under_wide.shards.get().gpu_indices) == 2, "placed with wide's settings"
    assert Event.objects.filter(message__contains="under profile wide").exists()

    set_observed(under_wide, Replica.Observed.READY)
    run_tick(lead)
    scale = ProfileScale.objects.get(model=model, profile=wide)
    assert scale.demand_at is None and scale.last_request_at is not None, "demand met"
    assert len(running(model)) == 2, "each profile keeps its own replicas"


def test_a_profile_minimum_is_kept_and_a_dropped_profile_is_retired(
    lead: leases.Leadership,
) -> None:
    make_node("a", gpus=gib(80, 80, 80))
    model = make_model("m", min_replicas=0, idle_timeout_s=3600)
    other = make_profile("other")
    model.profiles.add(other)
    ProfileScale.objects.create(model=model, profile=other, min_replicas=2, max_replicas=2)
    run_tick(lead)
    replicas = running(model)
    assert len(replicas) == 2 and {r.profile_id for r in replicas} == {other.pk}
    for replica in replicas:
        set_observed(replica, Replica.Observed.READY)

    model.profiles.remove(other)
    run_tick(lead)
    assert running(model) == []
    assert model.replicas.filter(desired=Replica.Desired.DRAINING).count() == 2


@pytest.mark.parametrize(
    ("placed", "resume_after", "asks"), [(2, 7, True), (0, 7, False), (2, None, False)]
)
def test_the_tick_task_asks_for_the_next_tick_at_once_only_while_a_wave_is_placed(
    monkeypatch: pytest.MonkeyPatch, placed: int, resume_after: int | None, asks: bool
) -> None:
    result = TickResult(acted=True, placed=placed, resume_after=resume_after)
    monkeypatch.setattr(process_reconciler(), "run_once", lambda: result)
    asked: list[bool] = []
    monkeypatch.setattr(serving, "request_tick", lambda: asked.append(True))
    tasks.reconcile()
    assert asked == ([True] if asks else [])
