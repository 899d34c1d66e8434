"""`manage.py revoke_node_cert NODE`: the node's certificate opens no stream any more.

Its open streams are closed at once where the channel layer reaches them, and within one
resync interval on every web process regardless.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import node_certs


class Command(BaseCommand):
    help = "Revoke NODE's client certificate; its open streams are closed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node")

    def handle(self, *args: Any, node: str, **options: Any) -> None:
        if not node_certs.revoke_node_cert(node):
            raise CommandError(f"node {node!r} has no valid certificate to revoke")
        self.stdout.write(f"node {node}: certificate revoked")
