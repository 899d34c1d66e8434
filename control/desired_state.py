"""A node's desired state: the full snapshot its agent converges to, read from the store.

Never incremental: every snapshot lists every shard the node should run, drain or stop, and
the weights to remove, stamped with the leader's epoch and the node's desired revision, so a
re-sent or repeated snapshot is harmless and a lost one is repaired by the next.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.protocol.messages import DesiredShard, DesiredState
from agents.protocol.vocabulary import DesiredShardState, Engine
from control import leases
from control.models import Node, Replica, Shard

Observed = Replica.Observed


def current_epoch() -> int:
    """The leader epoch desired state is stamped with (0 before anybody ever led)."""
    view = leases.read()
    return view.epoch if view is not None else 0


def build_desired_state(node_id: int) -> DesiredState:
    """The node's full desired state, read from the database (the one source of truth)."""
    with transaction.atomic():
        node = Node.objects.only("name", "desired_revision", "remove_weights").get(pk=node_id)
        shards = list(
            Shard.objects.filter(node_id=node_id)
            .select_related("replica__model", "replica__profile")
            .order_by("pk")
        )
        multi = [s.replica_id for s in shards if s.replica.profile.shards_per_replica > 1]
        heads = {
            head.replica_id: head
            for head in Shard.objects.filter(replica_id__in=multi, rank=0).select_related("node")
        }
        epoch = current_epoch()
    drain_timeout = float(settings.LLMGW_DRAIN_TIMEOUT)
    now = timezone.now()
    out: list[DesiredShard] = []
    for shard in shards:
        replica = shard.replica
        if replica.desired == Replica.Desired.STOPPED and shard.observed in (
            Observed.STOPPED,
            Observed.FAILED,
            Observed.PENDING,
        ):
            continue  # nothing runs that would need stopping; leave it out of the snapshot
        profile = replica.profile
        head = heads.get(replica.pk)
        state = DesiredShardState(str(replica.desired))
        timeout = drain_timeout
        if replica.desired == Replica.Desired.DRAINING:
            if replica.drain_held:
                # The gateway still has requests in flight on it: keep it serving them.
                state = DesiredShardState.RUNNING
            elif replica.draining_since is not None:
                # One drain timeout in all, the time held for the gateway included.
                spent = (now - replica.draining_since).total_seconds()
                timeout = max(0.0, drain_timeout - spent)
        out.append(
            DesiredShard(
                shard_id=shard.pk,
                replica_id=replica.pk,
                generation=replica.generation,
                state=state,
                engine=Engine(str(profile.engine)),
                model=replica.model.name,
                source=replica.model.source,
                port=shard.port,
                args=tuple(str(a) for a in (profile.args or [])),
                env={str(k): str(v) for k, v in (profile.env or {}).items()},
                gpu_indices=tuple(int(i) for i in (shard.gpu_indices or [])),
                rank=shard.rank,
                world_size=profile.shards_per_replica,
                head_address=(head.node.addresses or [""])[0] if head is not None else "",
                head_port=head.port if head is not None else 0,
                health_path=profile.health_path,
                startup_timeout_s=float(profile.startup_timeout_s),
                drain_timeout_s=timeout,
                api_key=replica.engine_key,
            )
        )
    return DesiredState(
        node=node.name,
        epoch=epoch,
        revision=node.desired_revision,
        shards=tuple(out),
        remove_weights=tuple(str(w) for w in (node.remove_weights or [])),
    )
