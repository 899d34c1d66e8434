"""One reconciler tick: its steps, their order, and what each decides.

A tick refreshes node health, reads one snapshot, then, in this order: stops the replicas on
lost nodes, restarts failed ones after their backoff, lets held drains go once the gateway's
requests finished, stops drained replicas, scales each model under each of its profiles (place,
note why not, drain, stop, forget served demand), and settles weight removals. The decisions
are pure (``control.lifecycle``, ``control.scaling``, ``control.placement``); each is carried
out as its own fenced state change in :mod:`control.leader_operations`, and the snapshot's
values are updated where a later step reads what an earlier one changed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property

from django.conf import settings
from django.utils import timezone

from control import health, leases, lifecycle, placement, scaling, weights
from control.leader_operations import (
    change_desired,
    create_replica,
    note_unplaceable,
    release_drain,
    reset_failures,
    restart_replica,
    satisfy_demand,
    satisfy_profile_demand,
    schedule_restart,
    settle_weight_removals,
)
from control.leases import Leadership
from control.models import LIVE_SHARD_STATES, Node, Replica, ServedModel
from control.reconciler.snapshot import (
    ReplicaView,
    ScaleUnit,
    Snapshot,
    fleet_of,
    read_snapshot,
    replica_request,
)
from telemetry import tracing

# The share of a tick's budget the scaling step has however long the snapshot took.
MIN_SCALING_SHARE = 0.25


@dataclass
class TickResult:
    acted: bool
    epoch: int = 0
    placed: int = 0
    changed: int = 0
    lost_leadership: bool = False
    # The budget ran out after this model: the next tick goes on from the one after it.
    resume_after: int | None = None

    @property
    def more_to_place(self) -> bool:
        """It placed, and stopped on its budget with models left: a wave is being placed,
        and the next tick should come now rather than at the next beat."""
        return self.placed > 0 and self.resume_after is not None


def tick(
    lead: Leadership,
    now: datetime | None = None,
    *,
    budget: float | None = None,
    resume_after: int | None = None,
    heard_from: datetime | None = None,
) -> TickResult:
    """One pass over the whole fleet. Raises LeadershipLost if the lease goes mid-tick.
    ``heard_from``: when this process found the store again after losing it (nodes' silence
    counts from then at the earliest, see ``health.refresh_node_health``).

    ``budget`` (seconds) bounds the tick: each placement is a transaction of its own, so a
    wave of hundreds of activations would make one tick last seconds; past the budget the tick
    stops between two models and the next one goes on after ``resume_after``. The budget
    counts from the tick's start (a slow read of the fleet leaves less for placing), but the
    scaling step always has a quarter of it, so a loaded store still sees progress. With
    tracing on, the tick is a span (each placement a child: ``create_replica``)."""
    with tracing.span("reconcile tick", {"llmgw.lease.epoch": lead.epoch}) as span:
        result = _tick(lead, now, budget=budget, resume_after=resume_after, heard_from=heard_from)
        span.set_attribute("llmgw.tick.placed", result.placed)
        span.set_attribute("llmgw.tick.changed", result.changed)
        if result.resume_after is not None:
            span.set_attribute("llmgw.tick.resume_after_model", result.resume_after)
        return result


def _tick(
    lead: Leadership,
    now: datetime | None,
    *,
    budget: float | None,
    resume_after: int | None,
    heard_from: datetime | None,
) -> TickResult:
    started = time.monotonic()
    now = now or timezone.now()
    with leases.fenced(lead):
        health.refresh_node_health(now, heard_from=heard_from)
    snapshot = read_snapshot(now)
    result = TickResult(acted=True, epoch=lead.epoch)
    _abandon_lost(lead, snapshot, result)
    _restart_failed(lead, snapshot, result)
    _release_held_drains(lead, snapshot, result)
    _finish_drains(lead, snapshot, result)
    deadline = None
    if budget is not None:
        deadline = max(started + budget, time.monotonic() + budget * MIN_SCALING_SHARE)
    _scale_all(lead, snapshot, result, deadline=deadline, resume_after=resume_after)
    _settle_weight_removals(lead, snapshot, result)
    return result


def _settle_weight_removals(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """Drop weight removals the agent finished, or that a re-added model cancels."""
    sources = {model.source for model in snapshot.models.values()}
    for node in snapshot.nodes.values():
        if not node.remove_weights:  # the common case: nothing to settle, no report to decode
            continue
        keep = weights.settled_removals(node, sources)
        if keep != node.remove_weights:
            if settle_weight_removals(lead, node.pk, node.remove_weights, keep):
                result.changed += 1


def _subject(snapshot: Snapshot, replica: ReplicaView) -> str:
    return f"model/{snapshot.models[replica.model_id].name}"


def _abandon_lost(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """Replicas with a shard on a lost node are stopped; the scale step places replacements.
    A lost node that returns is sent "stop" for them, so duplicates do not survive."""
    lost = {pk for pk, node in snapshot.nodes.items() if node.health == Node.Health.LOST}
    for replica in snapshot.replicas:
        on_lost = sorted(
            {snapshot.nodes[s.node_id].name for s in replica.shards if s.node_id in lost}
        )
        if on_lost and replica.desired != Replica.Desired.STOPPED:
            if change_desired(
                lead,
                replica.id,
                from_states=[Replica.Desired.RUNNING, Replica.Desired.DRAINING],
                to=Replica.Desired.STOPPED,
                subject=_subject(snapshot, replica),
                why=f"node {', '.join(on_lost)} lost",
            ):
                replica.desired = Replica.Desired.STOPPED
                result.changed += 1


def _restart_failed(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    for replica in snapshot.replicas:
        if replica.desired != Replica.Desired.RUNNING:
            continue
        if replica.observed == Replica.Observed.READY and replica.failures:
            reset_failures(lead, replica.id)
        if replica.observed != Replica.Observed.FAILED:
            continue
        if replica.backoff_until is None:
            schedule_restart(
                lead, replica.id, replica.failures, _subject(snapshot, replica), snapshot.now
            )
            result.changed += 1
        elif replica.backoff_until <= snapshot.now:
            restart_replica(lead, replica.id, _subject(snapshot, replica))
            result.changed += 1


def _release_held_drains(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """A draining replica held for the gateway's requests in flight is let go to its agent
    once they finished, or once the drain timeout passed."""
    timeout = timedelta(seconds=float(settings.LLMGW_DRAIN_TIMEOUT))
    for replica in snapshot.replicas:
        if replica.desired != Replica.Desired.DRAINING or not replica.drain_held:
            continue
        began = replica.draining_since or snapshot.now
        if replica.gateway_in_flight == 0 or snapshot.now >= began + timeout:
            why = "no request in flight" if replica.gateway_in_flight == 0 else "drain timeout"
            if release_drain(lead, replica.id, _subject(snapshot, replica), why):
                replica.drain_held = False
                result.changed += 1


def _finish_drains(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """A draining replica whose shards all stopped is stopped."""
    for replica in snapshot.replicas:
        if replica.desired != Replica.Desired.DRAINING:
            continue
        if all(s.observed not in LIVE_SHARD_STATES for s in replica.shards):
            if change_desired(
                lead,
                replica.id,
                from_states=[Replica.Desired.DRAINING],
                to=Replica.Desired.STOPPED,
                subject=_subject(snapshot, replica),
                why="drained",
            ):
                replica.desired = Replica.Desired.STOPPED
                result.changed += 1


def _leaving(snapshot: Snapshot, replica: ReplicaView) -> bool:
    """On a node the operator is draining: to be replaced, then drained."""
    return any(snapshot.nodes[s.node_id].schedule == Node.Schedule.DRAINING for s in replica.shards)


def _unit_key_of(model: ServedModel, replica: ReplicaView) -> str:
    if replica.profile_id == model.default_profile_id:
        return model.name
    return f"{model.name}@{replica.profile_name}"


def _use(model: ServedModel, replica: ReplicaView) -> lifecycle.ReplicaUse:
    return lifecycle.ReplicaUse(
        replica_id=replica.id,
        model=_unit_key_of(model, replica),
        ready=replica.observed == Replica.Observed.READY,
        pinned=model.pinned,
        in_flight=replica.in_flight,
        last_request_at=replica.last_request_at or model.last_request_at,
    )


@dataclass
class ScalingView:
    """What scaling sees during one tick. A replica placed for one model is added at once, so
    the models after it see the GPUs and ports it took."""

    snapshot: Snapshot
    replicas: list[scaling.ReplicaState]
    min_replicas: dict[str, int]

    @cached_property
    def fleet(self) -> scaling.Fleet:
        """Built when a model first needs it (to place, or to evict for): most ticks place
        nothing, and building it every tick was a measurable share of a steady one
        (docs/decisions.md, 'the tick's snapshot')."""
        return fleet_of(self.snapshot)

    @classmethod
    def of(cls, snapshot: Snapshot) -> ScalingView:
        replicas = [
            scaling.ReplicaState(
                _use(snapshot.models[r.model_id], r),
                draining=r.desired == Replica.Desired.DRAINING,
                leaving=_leaving(snapshot, r),
            )
            for r in snapshot.replicas
            if r.desired in (Replica.Desired.RUNNING, Replica.Desired.DRAINING)
        ]
        minimum = {
            unit.key: unit.min_replicas for units in snapshot.units.values() for unit in units
        }
        return cls(snapshot, replicas, minimum)

    @cached_property
    def _by_unit(self) -> dict[str, list[scaling.ReplicaState]]:
        by_unit: dict[str, list[scaling.ReplicaState]] = defaultdict(list)
        for state in self.replicas:
            by_unit[state.use.model].append(state)
        return by_unit

    def replicas_of(self, key: str) -> list[scaling.ReplicaState]:
        """The running and draining replicas of one scaling unit, without a scan of all."""
        return self._by_unit.get(key, [])

    def record_placement(
        self, unit: ScaleUnit, replica_id: int, where: placement.Placement
    ) -> None:
        self.fleet = self.fleet.holding(replica_id, where)
        use = lifecycle.ReplicaUse(
            replica_id, unit.key, False, unit.model.pinned, 0, unit.model.last_request_at
        )
        state = scaling.ReplicaState(use, draining=False)
        self._by_unit[unit.key].append(state)  # (the index first: built now, it would hold it)
        self.replicas.append(state)


def models_in_turn(models: Iterable[ServedModel], resume_after: int | None) -> list[ServedModel]:
    """Models by id, starting after ``resume_after`` and wrapping around, so a tick cut short
    by its budget does not leave the same models waiting tick after tick (pure)."""
    ordered = sorted(models, key=lambda m: m.pk)
    if resume_after is None:
        return ordered
    return [m for m in ordered if m.pk > resume_after] + [
        m for m in ordered if m.pk <= resume_after
    ]


def _scale_all(
    lead: Leadership,
    snapshot: Snapshot,
    result: TickResult,
    *,
    deadline: float | None = None,
    resume_after: int | None = None,
) -> None:
    view = ScalingView.of(snapshot)
    for model in models_in_turn(snapshot.models.values(), resume_after):
        units = list(snapshot.units[model.pk])
        # Replicas under a profile the model no longer lists are retired as a unit of their
        # own (nothing wanted), so they drain once idle instead of running on for ever.
        listed = {unit.profile.pk for unit in units}
        gone = {r.profile_id for r in snapshot.replicas_of(model.pk)} - listed
        units += [
            ScaleUnit(model, profile, retired=True)
            for profile in sorted(
                (snapshot.profiles[pk] for pk in gone if pk in snapshot.profiles),
                key=lambda p: p.name,
            )
        ]
        for unit in units:
            _scale(lead, view, unit, snapshot.now, result)
        if deadline is not None and time.monotonic() >= deadline:
            result.resume_after = model.pk
            break


def _scale(
    lead: Leadership, view: ScalingView, unit: ScaleUnit, now: datetime, result: TickResult
) -> None:
    """Carry out the scaling decision for one model under one profile, one state change per
    action, in order."""
    model = unit.model
    mine = [r.use for r in view.replicas_of(unit.key) if not r.draining]
    decision = scaling.scale(
        scaling.ModelScale(unit.key, unit.demand(mine), replica_request(model, unit.profile)),
        view.replicas,
        lambda: view.fleet,
        own=view.replicas_of(unit.key),
        min_replicas=view.min_replicas,
        now=now,
        port_range=settings.LLMGW_PORT_RANGE,
    )
    for action in decision:
        match action:
            case scaling.SatisfyDemand():
                if unit.default:
                    satisfy_demand(lead, model)
                elif unit.row is not None:
                    satisfy_profile_demand(lead, unit.row)
            case scaling.Place(where, why):
                replica_id = create_replica(
                    lead, model, where, why, unit.profile, node_ids=view.snapshot.node_ids
                )
                view.record_placement(unit, replica_id, where)
                result.placed += 1
            case scaling.NoteUnplaceable(reason):
                note = reason if unit.default else f"under profile {unit.profile.name}: {reason}"
                note_unplaceable(lead, model, note)
            case scaling.Drain(replica_id, owner, why):
                if _retire(lead, replica_id, Replica.Desired.DRAINING, owner, why):
                    result.changed += 1
            case scaling.Stop(replica_id, owner, why):
                if _retire(lead, replica_id, Replica.Desired.STOPPED, owner, why):
                    result.changed += 1


def _retire(lead: Leadership, replica_id: int, to: str, model: str, why: str) -> bool:
    """A running replica of ``model`` is to drain or stop."""
    return change_desired(
        lead,
        replica_id,
        from_states=[Replica.Desired.RUNNING],
        to=to,
        subject=f"model/{model}",
        why=why,
    )
