"""`manage.py serve_agents_grpc`: the agents' gRPC listener (``manage.py run`` starts it when
``LLMGW_AGENT_LISTEN`` is set).

Mutual TLS with ``LLMGW_AGENT_REQUIRE_IDENTITY`` or ``LLMGW_AGENT_GRPC_REQUIRE_IDENTITY`` (node
certificates from ``init_ca`` / ``issue_node_cert``); TLS with node tokens when a CA exists;
plaintext otherwise (loopback).
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import agent_grpc, node_certs


class Command(BaseCommand):
    help = "Serve agent streams over gRPC until SIGTERM."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen",
            default=settings.LLMGW_AGENT_LISTEN,
            metavar="HOST:PORT",
            help="where to listen (default: LLMGW_AGENT_LISTEN)",
        )

    def handle(self, *args: Any, listen: str, **options: Any) -> None:
        if not listen:
            raise CommandError("give --listen HOST:PORT or set LLMGW_AGENT_LISTEN")
        try:
            asyncio.run(agent_grpc.serve(listen))
        except node_certs.CaError as exc:
            raise CommandError(str(exc)) from None
        except RuntimeError as exc:  # grpc: the port could not be bound
            raise CommandError(f"cannot listen on {listen}: {exc}") from None
