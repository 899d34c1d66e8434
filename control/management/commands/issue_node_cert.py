"""`manage.py issue_node_cert NODE`: a client certificate and key for a node's agent.

The certificate names the node (its common name) and is signed by the cluster CA; the node is
registered if new. Its earlier certificate stops working at once (open streams are closed).
Give the agent ``--tls-ca DIR/ca.pem --tls-cert DIR/NODE.pem --tls-key DIR/NODE.key``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.protocol.names import valid_node_name
from control import node_certs


class Command(BaseCommand):
    help = "Issue NODE a client certificate from the cluster CA (its previous one stops working)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node", help="The node's name, as its agent's --node says.")
        parser.add_argument(
            "--output-dir",
            type=Path,
            help="where to write NODE.pem, NODE.key (mode 0600) and ca.pem "
            "(default: LLMGW_CA_DIR/nodes/NODE)",
        )

    def handle(self, *args: Any, node: str, output_dir: Path | None, **options: Any) -> None:
        if not valid_node_name(node):
            raise CommandError(f"{node!r} is not a node name: use letters, digits, '-' and '_'")
        ca_dir = Path(settings.LLMGW_CA_DIR)
        out = output_dir or ca_dir / "nodes" / node
        try:
            issued = node_certs.issue_node_cert(node, ca_dir, out)
        except node_certs.CaError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"node {node}: certificate {issued.cert_path}, key {issued.key_path} (mode 0600), "
            f"CA {issued.ca_path}; serial {issued.serial}"
        )
