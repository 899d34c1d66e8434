"""Real processes on loopback."""

from __future__ import annotations

import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
