"""``manage.py list_nodes [--json]``: every node, its state, GPUs and last heartbeat."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from control import dashboard


class Command(BaseCommand):
    help = "List nodes: state, GPUs allocated/total, memory in use, last heartbeat."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--json", action="store_true", dest="as_json", help="Print JSON instead of a table."
        )

    def handle(self, *args: Any, as_json: bool, **options: Any) -> None:
        nodes = dashboard.nodes()
        if as_json:
            self.stdout.write(json.dumps(nodes, indent=2))
            return
        if not nodes:
            self.stdout.write("no nodes (issue a token with manage.py issue_node_token NAME)")
            return
        rows = [("NODE", "STATE", "GPUS", "MEMORY USED", "HEARTBEAT", "AGENT")]
        for node in nodes:
            gpus = node["gpus"]
            allocated = sum(1 for gpu in gpus if gpu["allocated_to"])
            used = sum(gpu["memory_used_mib"] for gpu in gpus) / 1024
            total = sum(gpu["memory_total_mib"] for gpu in gpus) / 1024
            age = node["heartbeat_age_s"]
            rows.append(
                (
                    node["name"],
                    node["state"],
                    f"{allocated}/{len(gpus)}",
                    f"{used:.1f}/{total:.1f} GiB",
                    "never" if age is None else f"{age:.0f}s ago",
                    node["agent_version"] or "-",
                )
            )
        self.stdout.write(table(rows))


def table(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, for a terminal."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
