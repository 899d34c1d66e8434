"""A private ``redis-server`` on a free loopback port: nobody else's keys, and a test may stop
and restart it. Where ``redis-server`` is missing the test is skipped, except under
``CI=true``, where a missing Redis fails the run (CI must test what it claims to)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from tests.harness.procs import Proc, free_port
from tests.harness.waits import wait_until


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return binary


class RedisServer:
    """One redis-server keeping nothing on disk."""

    def __init__(self, log_dir: Path, port: int = 0) -> None:
        self.port = port or free_port()
        argv = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        self.proc = Proc("redis", argv, log_dir, port=self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> RedisServer:
        self.proc.start()
        wait_until(self.answers, what="redis-server answering PING", logs=[self.proc])
        return self

    def stop(self) -> None:
        self.proc.stop()

    def ensure_running(self) -> None:
        if not self.proc.running():
            self.start()
