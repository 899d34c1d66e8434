"""A process that answers diagnostics (``telemetry.diagnostics``) and does known things for the
tests to find in its answers: a thread busy in :func:`spin_in_a_known_function`, a task waiting
in :func:`wait_in_a_known_coroutine`, a list that grows in :func:`leak_a_known_allocation` (of
``Leaked`` objects, which the collector tracks), an event loop stalled for 300 ms every five
seconds, and a file and a TCP connection held open for the connection counts.

    python -m tests.harness.diagnosed FOLDER ROLE HELD_FILE TCP_PORT

It prints ``ready`` once its channel listens, then runs until it is stopped. :func:`started`
starts one for a test, with the file and the listening socket it holds on to.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from telemetry import diagnostics
from telemetry.vitals import Peer
from tests.harness.procs import PYTHON, Proc
from tests.harness.waits import wait_until

STALL_S = 0.3
STALL_EVERY_S = 5.0


class Leaked:
    """What the leak keeps: one object the collector tracks, and a KiB of bytes."""

    def __init__(self) -> None:
        self.payload = bytes(1024)  # the leaked bytes


def spin_in_a_known_function() -> None:
    # A fifth of a core: busy enough for a CPU profile, light on a shared machine.
    while True:
        until = time.perf_counter() + 0.01
        while time.perf_counter() < until:
            sum(i * i for i in range(200))
        time.sleep(0.04)


def leak_a_known_allocation(kept: list[Leaked]) -> None:
    # About 100 KiB a second: a few MiB over a module's tests.
    while True:
        kept.append(Leaked())  # the leaking line
        time.sleep(0.01)


async def wait_in_a_known_coroutine() -> None:
    await asyncio.sleep(3600)


def stall(loop: asyncio.AbstractEventLoop) -> None:
    time.sleep(STALL_S)  # on the event loop: what a blocking call does to it
    loop.call_later(STALL_EVERY_S, stall, loop)


async def main(folder: Path, role: str, held: Path, port: int) -> None:
    loop = asyncio.get_running_loop()
    peers = (Peer("store", path=str(held)), Peer("redis", host="127.0.0.1", port=port))
    diagnostics.serve(folder, diagnostics.Process(role, loop=loop, peers=peers))
    with held.open("rb"), socket.create_connection(("127.0.0.1", port)):
        threading.Thread(target=spin_in_a_known_function, name="busy", daemon=True).start()
        kept: list[Leaked] = []
        threading.Thread(target=leak_a_known_allocation, args=(kept,), daemon=True).start()
        waiting = asyncio.create_task(wait_in_a_known_coroutine(), name="known task")
        # Stopped as llmgw's processes are, it exits as they do: its socket file goes with it.
        loop.add_signal_handler(signal.SIGTERM, waiting.cancel)
        loop.call_later(1.0, stall, loop)
        print("ready", flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await waiting


@dataclass
class Diagnosed:
    proc: Proc
    held: Path  # the file it holds open
    port: int  # where its one TCP connection goes


@contextlib.contextmanager
def started(folder: Path, work: Path, role: str = "test") -> Iterator[Diagnosed]:
    """One such process answering in ``folder``, its log and files under ``work``."""
    held = work / "held-open"
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_bytes(b"x")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = int(listener.getsockname()[1])
        argv = [PYTHON, "-m", "tests.harness.diagnosed", str(folder), role, str(held), str(port)]
        proc = Proc(f"diagnosed-{role}", argv, work / "logs").start()
        try:
            wait_until(lambda: "ready" in proc.log(), what="its channel", running=[proc])
            yield Diagnosed(proc, held, port)
        finally:
            proc.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])))
