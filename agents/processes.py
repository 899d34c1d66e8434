"""Engine processes as the supervisor drives them: started by a launcher, watched and stopped
through a handle.

The supervisor knows only :class:`ProcessHandle` and :class:`Launcher`, so an engine simulated
inside the agent's own process can stand in for a real one. The real ones are plain ``Popen``
children in their own session, watched by polling: an agent that exits with
``--leave-shards-running`` leaves them untouched (asyncio's subprocess transports would kill
them on close), and the next agent finds them again by their :class:`ProcessMark`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from agents.engines import Launch
from agents.protocol.messages import DesiredShard
from agents.protocol.vocabulary import LOG_LINE_MAX_CHARS

LOG_TAIL_LINES: Final = 20


@dataclass(frozen=True)
class ProcessMark:
    """Enough to find a process again after the agent restarts: its pid, and when it started
    (clock ticks since boot), which tells it from a later process that reused the pid."""

    pid: int
    start: str


class ProcessHandle(Protocol):
    """One running engine."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None:
        """The exit code once the engine has ended (None while it runs or when unknown)."""

    def exited(self) -> bool: ...

    def terminate(self) -> None:
        """Ask the engine to shut down gracefully (it may finish what it serves)."""

    def kill(self) -> None:
        """End the engine now."""

    def mark(self) -> ProcessMark | None:
        """How a later agent can find this engine again; None when it cannot (it has ended,
        or it lives inside this agent)."""


class Launcher(Protocol):
    """Starts one engine with the command its recipe gave, its output going to ``log_path``."""

    async def __call__(
        self, spec: DesiredShard, command: Launch, log_path: Path, cwd: Path
    ) -> ProcessHandle: ...


def process_start_ticks(pid: int) -> str | None:
    """When a process started (clock ticks since boot), to tell it from a later one that
    reused its pid. None when it is gone (or this is not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields after it are plain.
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] == "Z":  # a zombie has exited already
        return None
    return fields[19]


def _signal_group(pid: int, signum: int) -> None:
    # The shard leads its own process group, so engines' workers get the signal too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


class ChildProcess:
    """An engine this agent started."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def terminate(self) -> None:
        _signal_group(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        _signal_group(self.pid, signal.SIGKILL)

    def mark(self) -> ProcessMark | None:
        start = process_start_ticks(self.pid)
        return None if start is None else ProcessMark(self.pid, start)


class AdoptedProcess:
    """An engine a previous agent started and left running; not our child, so no exit code."""

    def __init__(self, mark: ProcessMark) -> None:
        self._mark = mark

    @classmethod
    def find(cls, mark: ProcessMark) -> AdoptedProcess | None:
        """The process ``mark`` names if it still runs; None when it is gone."""
        return cls(mark) if process_start_ticks(mark.pid) == mark.start else None

    @property
    def pid(self) -> int:
        return self._mark.pid

    def poll(self) -> int | None:
        return None

    def exited(self) -> bool:
        return process_start_ticks(self.pid) != self._mark.start

    def terminate(self) -> None:
        if not self.exited():  # never signal a stranger that reused the pid
            _signal_group(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if not self.exited():
            _signal_group(self.pid, signal.SIGKILL)

    def mark(self) -> ProcessMark | None:
        return None if self.exited() else self._mark


def _popen(command: Launch, log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(  # noqa: S603 - argv from a recipe, no shell
            command.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(command.env),
            cwd=cwd,
            # Its own session: a signal to the agent's terminal or group does not reach it,
            # and the agent can signal the engine's whole process tree at once.
            start_new_session=True,
        )


async def spawn(spec: DesiredShard, command: Launch, log_path: Path, cwd: Path) -> ChildProcess:
    """The real launcher: the recipe's command as a child process. Raises OSError when it
    cannot be executed. Forks in a thread, so a large agent does not stall its event loop."""
    return ChildProcess(await asyncio.to_thread(_popen, command, log_path, cwd))


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last lines an engine wrote, each cut to the protocol's limit."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - 16 * 1024))
            data = log.read()
    except OSError:
        return ()
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > 16 * 1024 and text:
        text = text[1:]  # the first line was cut by the seek
    return tuple(line[:LOG_LINE_MAX_CHARS] for line in text[-lines:])


def exit_words(code: int | None) -> str:
    """How an engine ended, in words for a report."""
    if code is None:
        return "exited (code unknown: started by a previous agent)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
