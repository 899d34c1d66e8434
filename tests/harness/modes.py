"""File modes as another local user meets them: what under a folder is open to anyone but its
owner (a group or other bit set), found without following links."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What a login shell commonly has: files 0644, folders 0755.
SHELL_UMASK = 0o022


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def open_to_others(root: Path) -> dict[str, str]:
    """Every path at or under ``root`` (links themselves excluded: their mode means nothing)
    that a group or other bit opens, with its mode in octal. A file removed between the
    listing and its look (the running broker takes its messages away) is open to no one."""
    found: dict[str, str] = {}
    for path in [root, *root.rglob("*")]:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISLNK(info.st_mode) and info.st_mode & 0o077:
            found[str(path.relative_to(root.parent))] = oct(stat.S_IMODE(info.st_mode))
    return found


def everything_under(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


def shell_argv(*argv: str) -> list[str]:
    """``argv`` started as from a login shell with the common umask: the umask the process
    starts with is the user's, never this test process's."""
    return ["/bin/sh", "-c", f'umask {SHELL_UMASK:03o} && exec "$@"', "sh", *argv]


def run_from_a_shell(
    argv: list[str], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end as from a login shell (:func:`shell_argv`)."""
    return subprocess.run(
        shell_argv(*argv), env=env, cwd=cwd, capture_output=True, text=True, check=False
    )


@contextmanager
def umask(value: int) -> Iterator[None]:
    """This process's umask set to ``value`` meanwhile (it is the whole process's: no thread of
    a test may create files it cares about meanwhile)."""
    previous = os.umask(value)
    try:
        yield
    finally:
        os.umask(previous)


def assert_owner_only(root: Path) -> None:
    """Nothing at or under ``root`` is open to another local user (the message lists what is)."""
    loose = open_to_others(root)
    assert not loose, f"open to other local users: {loose}"
