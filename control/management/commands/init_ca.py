"""`manage.py init_ca`: make the cluster's certificate authority for agent node identities.

Writes ``ca.pem`` and ``ca.key`` (mode 0600) and the agent listener's ``server.pem`` /
``server.key`` to ``LLMGW_CA_DIR`` (default ``var/ca``). The server certificate is valid for
the names given with ``--server-name`` (the host names and addresses agents dial).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import node_certs


class Command(BaseCommand):
    help = "Create the cluster CA and the agent listener's server certificate."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--server-name",
            dest="server_names",
            action="append",
            metavar="NAME",
            help="a host name or address agents reach the agent listener by (repeatable; "
            "default: localhost and 127.0.0.1)",
        )
        parser.add_argument("--dir", type=Path, help="where to write (default: LLMGW_CA_DIR)")
        parser.add_argument(
            "--force",
            action="store_true",
            help="replace an existing CA (every node certificate must then be issued again)",
        )

    def handle(
        self,
        *args: Any,
        server_names: list[str] | None,
        dir: Path | None,
        force: bool,
        **options: Any,
    ) -> None:
        ca_dir = dir or Path(settings.LLMGW_CA_DIR)
        names = server_names or ["localhost", "127.0.0.1"]
        try:
            ca_path = node_certs.init_ca(ca_dir, names, force=force)
        except node_certs.CaError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"CA written to {ca_path} (key {ca_dir / node_certs.CA_KEY}, mode 0600); the agent "
            f"listener's certificate is valid for {', '.join(names)}."
        )
