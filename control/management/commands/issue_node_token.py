"""`manage.py issue_node_token NODE`: a new token for a node's agent, shown once.

The node is registered if it is new; an earlier token of the same node stops working at once
(its open streams are closed). Only a hash of the token is stored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.protocol.names import valid_node_name
from control import node_tokens


class Command(BaseCommand):
    help = "Issue a token for NODE's agent (registering the node if new); printed once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node", help="The node's name, as its agent's --node says.")
        parser.add_argument(
            "--output",
            type=Path,
            help="Write the token to this file (mode 0600) instead of printing it, for "
            "`python -m agents --token-file`.",
        )

    def handle(self, *args: Any, node: str, output: Path | None, **options: Any) -> None:
        if not valid_node_name(node):
            raise CommandError(f"{node!r} is not a node name: use letters, digits, '-' and '_'")
        token = node_tokens.issue_node_token(node)
        if output is None:
            self.stdout.write(token)
            self.stderr.write(
                f"Token for node {node} (shown once; give it to the agent as LLMGW_NODE_TOKEN "
                "or in --token-file)."
            )
            return
        output.parent.mkdir(parents=True, exist_ok=True)
        # Created with 0600 from the start: the token is never readable by others, not even
        # for the moment between writing and a chmod.
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        os.chmod(output, 0o600)
        self.stderr.write(f"Token for node {node} written to {output}.")
