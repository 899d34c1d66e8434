"""The agent's decisions: from the desired state and what runs on this node, what to do.

:func:`plan` is pure: plain data in, a list of actions out; no process, no I/O, no clock. The
supervisor (:mod:`agents.supervisor`) executes the actions and calls :func:`plan` again
whenever either side changes (a new desired state, a shard's lifecycle ending), so the node
converges level-triggered: a snapshot applied twice plans nothing the second time.

A shard incarnation is identified by its :func:`fingerprint`: a change there means stop the
old process and start a new one. A failed incarnation stays failed until the control plane
asks again with a new generation (its backoff, not ours); a stopped one is started again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from agents.protocol.messages import DesiredShard, DesiredState
from agents.protocol.vocabulary import DesiredShardState, ShardState

FINISHED: Final = frozenset({ShardState.STOPPED, ShardState.FAILED, ShardState.PENDING})


class Want(StrEnum):
    """What a shard's lifecycle is asked to do next."""

    RUN = "run"
    DRAIN = "drain"
    STOP = "stop"


_WANT_ORDER: Final = (Want.RUN, Want.DRAIN, Want.STOP)


def escalates(current: Want, wanted: Want) -> bool:
    """Stopping outranks draining outranks running, and a request never goes back: a drain in
    progress cannot be undone (the engine may have refused new work), so a later "running"
    waits for the stop and a fresh start."""
    return _WANT_ORDER.index(wanted) > _WANT_ORDER.index(current)


def fingerprint(spec: DesiredShard) -> str:
    """What identifies one incarnation: a change here means stop the old process and start
    anew. Timeouts, the health path and the desired state change in place."""
    identity = {
        k: v
        for k, v in spec.to_dict().items()
        if k not in ("state", "health_path", "startup_timeout_s", "drain_timeout_s")
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunningShard:
    """One shard incarnation this agent knows of, as the plan sees it."""

    spec: DesiredShard
    fingerprint: str
    state: ShardState
    want: Want
    # Nothing runs and nothing works on it any more: it holds no port and may be restarted.
    finished: bool


@dataclass(frozen=True)
class NodeFacts:
    """What the node offers shards: its engine port range and the GPU indices it has."""

    port_range: tuple[int, int]
    gpus: frozenset[int]


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Start:
    """Start a new incarnation (replacing a finished one of the same shard, if any)."""

    spec: DesiredShard
    fingerprint: str


@dataclass(frozen=True)
class Refuse:
    """This node cannot run the shard as specified: record it failed, start nothing."""

    spec: DesiredShard
    fingerprint: str
    reason: str


@dataclass(frozen=True)
class Wait:
    """Not yet: a shard on its way out still holds a port or GPU the spec needs. Nothing is
    started; the end of that shard's life plans again."""

    spec: DesiredShard
    fingerprint: str
    reason: str


@dataclass(frozen=True)
class Update:
    """The same incarnation with new timeouts or health path: take them in place."""

    spec: DesiredShard


@dataclass(frozen=True)
class Drain:
    """Let the shard's requests in flight finish, then stop it."""

    shard_id: int


@dataclass(frozen=True)
class Stop:
    """Stop the shard's process; ``why`` (if any) completes the log line "shard N ..."."""

    shard_id: int
    why: str = ""


@dataclass(frozen=True)
class RecordStopped:
    """Nothing runs and nothing should: remember it as stopped, so it is reported."""

    spec: DesiredShard
    fingerprint: str


@dataclass(frozen=True)
class Forget:
    """No longer wanted and nothing runs: drop it from the reports."""

    shard_id: int


Action = Start | Refuse | Wait | Update | Drain | Stop | RecordStopped | Forget


# --------------------------------------------------------------------------- the decision


def refusal(
    spec: DesiredShard,
    node: NodeFacts,
    busy_ports: Mapping[int, int],
    busy_gpus: Mapping[int, int],
) -> str:
    """Why this node cannot run ``spec``, or ''. ``busy_ports`` and ``busy_gpus`` map a port
    or GPU index to the shard that holds it and keeps it."""
    low, high = node.port_range
    if not low <= spec.port <= high:
        return f"port {spec.port} is outside this agent's port range {low}-{high}"
    holder = busy_ports.get(spec.port)
    if holder is not None and holder != spec.shard_id:
        return f"port {spec.port} is already used by shard {holder}"
    missing = [i for i in spec.gpu_indices if i not in node.gpus]
    if missing:
        have = ",".join(str(i) for i in sorted(node.gpus)) or "none"
        return f"GPU(s) {missing} do not exist on this node (it has {have})"
    taken = _held(spec, spec.gpu_indices, busy_gpus)
    if taken:
        return f"GPU(s) {sorted(taken)} already used by shard(s) {sorted(set(taken.values()))}"
    return ""


def _held(spec: DesiredShard, keys: tuple[int, ...], holders: Mapping[int, int]) -> dict[int, int]:
    """Which of ``keys`` (ports or GPU indices) another shard than ``spec``'s holds."""
    return {k: h for k in keys if (h := holders.get(k)) is not None and h != spec.shard_id}


def _waiting_for(
    spec: DesiredShard, freed_ports: Mapping[int, int], freed_gpus: Mapping[int, int]
) -> str:
    """What ``spec`` waits for from shards on their way out, or '' when nothing."""
    held = []
    if port := _held(spec, (spec.port,), freed_ports):
        held.append(f"port {spec.port} (shard {port[spec.port]})")
    if gpus := _held(spec, spec.gpu_indices, freed_gpus):
        held.append(f"GPU(s) {sorted(gpus)} (shard(s) {sorted(set(gpus.values()))})")
    return f"waiting for stopping shards to free {' and '.join(held)}" if held else ""


def plan(
    desired: DesiredState | None, running: Mapping[int, RunningShard], node: NodeFacts
) -> list[Action]:
    """What to do, in order, so that what runs on a node offering ``node`` matches
    ``desired``. ``running`` holds every incarnation the agent knows of, by shard id."""
    if desired is None:
        return []  # nothing is stopped before the control plane has said what it wants
    actions: list[Action] = []
    wanted = {s.shard_id: s for s in desired.shards}
    # A live incarnation still wanted running keeps its port and GPUs: a new shard asking for
    # them is refused (the control plane placed two on one). One on its way out (not wanted,
    # wanted drained or stopped, or changed) frees them when its process ends: a new shard
    # waits for that, so two engines never share a GPU, as when a node back from being lost
    # still runs the engine of a replica placed elsewhere meanwhile. What this plan starts
    # keeps its own.
    kept_ports: dict[int, int] = {}
    kept_gpus: dict[int, int] = {}
    freed_ports: dict[int, int] = {}
    freed_gpus: dict[int, int] = {}
    for live in running.values():
        if live.finished:
            continue
        asked = wanted.get(live.spec.shard_id)
        keeps = (
            asked is not None
            and asked.state is DesiredShardState.RUNNING
            and fingerprint(asked) == live.fingerprint
        )
        ports, gpus = (kept_ports, kept_gpus) if keeps else (freed_ports, freed_gpus)
        ports[live.spec.port] = live.spec.shard_id
        gpus.update(dict.fromkeys(live.spec.gpu_indices, live.spec.shard_id))

    def start(spec: DesiredShard, fp: str) -> None:
        reason = refusal(spec, node, kept_ports, kept_gpus)
        if reason:
            actions.append(Refuse(spec, fp, reason))
            return
        waiting = _waiting_for(spec, freed_ports, freed_gpus)
        if waiting:
            actions.append(Wait(spec, fp, waiting))
            return
        kept_ports[spec.port] = spec.shard_id
        kept_gpus.update(dict.fromkeys(spec.gpu_indices, spec.shard_id))
        actions.append(Start(spec, fp))

    for shard_id, spec in wanted.items():
        rt = running.get(shard_id)
        fp = fingerprint(spec)
        if rt is not None and rt.fingerprint == fp and rt.spec != spec:
            actions.append(Update(spec))
        if spec.state is DesiredShardState.RUNNING:
            if rt is None:
                start(spec, fp)
            elif rt.finished:
                if rt.fingerprint != fp or rt.state is not ShardState.FAILED:
                    start(spec, fp)
            elif rt.fingerprint != fp and escalates(rt.want, Want.STOP):
                actions.append(Stop(shard_id, "changed: restarting it"))
        elif rt is None or (rt.finished and rt.state is ShardState.PENDING):
            # Never started (or waiting to): nothing runs, so it is simply stopped.
            actions.append(RecordStopped(spec, fp))
        elif spec.state is DesiredShardState.DRAINING:
            if not rt.finished and escalates(rt.want, Want.DRAIN):
                actions.append(Drain(shard_id))
        elif not rt.finished and escalates(rt.want, Want.STOP):
            actions.append(Stop(shard_id))
    for shard_id, rt in running.items():
        if shard_id in wanted:
            continue
        if rt.finished:
            actions.append(Forget(shard_id))
        elif escalates(rt.want, Want.STOP):
            actions.append(Stop(shard_id, "is not in the desired state: stopping it"))
    return actions
