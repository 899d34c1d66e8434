"""A process stopped while it holds a lock: what SIGSTOP, a debugger's attach or a frozen
container does to a process in mid-step. The lock is released when it ends (the kernel drops a
dead process's ``flock``)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@contextlib.contextmanager
def stopped_holding_flock(path: Path) -> Iterator[subprocess.Popen[str]]:
    """``path``'s exclusive ``flock`` held by a process that then stopped itself; it is let
    run and ended when the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=10)
