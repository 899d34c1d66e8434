"""`manage.py revoke_node_token NODE`: the node's agent can no longer connect; open streams
are closed. Exit status 1 when the node has no token to revoke."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from control import node_tokens


class Command(BaseCommand):
    help = "Revoke NODE's agent token and close its open streams."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node")

    def handle(self, *args: Any, node: str, **options: Any) -> None:
        if node_tokens.revoke_node_token(node):
            self.stdout.write(f"token of node {node} revoked")
            return
        self.stderr.write(f"node {node} does not exist or has no token")
        raise SystemExit(1)
