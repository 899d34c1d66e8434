"""What ``cordon``, ``drain`` and ``undrain`` share: resolve node names, call the one domain
function per node, say what changed. (The leading underscore keeps Django from listing this
module as a command.)"""

from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control.models import Node


def cli_actor() -> str:
    """Who did it, for the audit trail: the operating-system user running the command."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry (some containers)
        return "cli"


class NodeScheduleCommand(BaseCommand):
    verb = ""  # "cordoned", "draining", "active"

    def change(self, node_id: int, *, actor: str) -> bool:
        raise NotImplementedError

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("nodes", nargs="+", metavar="NODE", help="Node names.")

    def handle(self, *args: Any, nodes: list[str], **options: Any) -> None:
        found = dict(Node.objects.filter(name__in=nodes).values_list("name", "pk"))
        missing = [name for name in nodes if name not in found]
        if missing:
            raise CommandError(f"no such node: {', '.join(missing)} (see manage.py list_nodes)")
        actor = cli_actor()
        for name in nodes:
            if self.change(found[name], actor=actor):
                self.stdout.write(f"{name}: {self.verb}")
            else:
                self.stdout.write(f"{name}: already {self.verb}")
