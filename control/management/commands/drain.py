"""``manage.py drain NODE...``: move every replica off these nodes."""

from __future__ import annotations

from control import operations
from control.management.commands._node_schedule import NodeScheduleCommand


class Command(NodeScheduleCommand):
    help = (
        "Drain nodes: no new traffic or placements; replicas are placed elsewhere, in-flight "
        "requests finish, then the shards stop. Undo with undrain."
    )
    verb = "draining"

    def change(self, node_id: int, *, actor: str) -> bool:
        return operations.drain_node(node_id, actor=actor)
