"""``manage.py undrain NODE...``: cordoned or draining nodes become schedulable again."""

from __future__ import annotations

from control import operations
from control.management.commands._node_schedule import NodeScheduleCommand


class Command(NodeScheduleCommand):
    help = "Undrain (or uncordon) nodes: schedulable again."
    verb = "active"

    def change(self, node_id: int, *, actor: str) -> bool:
        return operations.undrain_node(node_id, actor=actor)
