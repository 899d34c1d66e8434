"""``manage.py cordon NODE...``: no new placements on these nodes; what runs there stays."""

from __future__ import annotations

from control import operations
from control.management.commands._node_schedule import NodeScheduleCommand


class Command(NodeScheduleCommand):
    help = "Cordon nodes: the reconciler places nothing new there; running replicas stay."
    verb = "cordoned"

    def change(self, node_id: int, *, actor: str) -> bool:
        return operations.cordon_node(node_id, actor=actor)
