"""What llmgw writes on this machine is its owner's alone: folders 0700, files 0600.

The store holds the sessions (a signed-in superuser's session key is the admin), each replica's
engine key and the profiles' environments; beside it lie the secret key, the CA's private keys,
the usage journals and the broker's task messages. Another local user must read none of it.

- :func:`restrict_umask` runs in the settings, before anything is created: whatever umask the
  shell that started llmgw had, every file a process of it creates is owner-only from its first
  byte. That covers what others create for us: SQLite's store (and its ``-wal``, ``-shm`` and
  ``-journal``, which SQLite gives the store's own mode), prometheus_client's files, beat's
  schedule, kombu's bindings, and the local agent and its engines (they inherit the umask).
  Our own code that creates a folder or a file names its mode as well (folders above it, where
  missing, take theirs from the umask).
- :func:`tighten` runs when ``manage.py run`` starts: what an older version (or another tool)
  left open under these paths is closed, and one log line names each path with its old mode.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from django.conf import settings

logger = logging.getLogger(__name__)

UMASK: Final = 0o077
_OTHERS: Final = 0o077  # the group and other bits: what tightening takes off
_NAMED_IN_THE_LOG: Final = 20


def restrict_umask() -> None:
    """Owner-only for everything this process (and every process it starts) creates."""
    os.umask(UMASK)


def llmgw_paths() -> list[Path]:
    """What llmgw writes to on this machine: the var folder, the folders that may be moved out
    of it, and an SQLite store's files wherever the store is."""
    return [
        Path(settings.VAR_DIR),
        Path(settings.LLMGW_CA_DIR),
        Path(settings.LLMGW_USAGE_JOURNAL_DIR),
        Path(settings.PROMETHEUS_MULTIPROC_DIR),
        *store_files(settings.DATABASES["default"]),
    ]


def store_files(database: Mapping[str, Any]) -> list[Path]:
    """An SQLite store's file and the ones SQLite keeps beside it; none for another store."""
    if database["ENGINE"] != "django.db.backends.sqlite3" or database["NAME"] == ":memory:":
        return []
    store = Path(str(database["NAME"]))
    return [store.with_name(store.name + end) for end in ("", "-wal", "-shm", "-journal")]


def tighten(paths: Iterable[Path]) -> list[tuple[Path, int]]:
    """Take the group and other bits off each of ``paths`` and everything under it (links are
    never followed below the given paths); log what was closed, with its old mode, in one line.
    Returns (path, old mode) for each path changed. What cannot be changed (another user's
    file) is logged and left."""
    closed: list[tuple[Path, int]] = []
    for top in _outermost(paths):
        if top.is_dir():
            for folder, _, files, folder_fd in os.fwalk(top):
                _tighten_open(Path(folder), folder_fd, closed)
                for name in files:
                    _tighten_named(Path(folder) / name, name, folder_fd, closed)
        elif top.exists():
            _tighten_named(top, str(top), None, closed)
    if closed:
        named = ", ".join(f"{path} (was {mode:04o})" for path, mode in closed[:_NAMED_IN_THE_LOG])
        more = len(closed) - _NAMED_IN_THE_LOG
        logger.warning(
            "made owner-only what other local users could open: %s%s",
            named,
            f", and {more} more" if more > 0 else "",
        )
    return closed


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """The given paths as they are on disk (a configured folder may be a link to another),
    without those inside another of them."""
    resolved = sorted({path.resolve() for path in paths}, key=lambda path: (len(path.parts), path))
    kept: list[Path] = []
    for path in resolved:
        if not any(path.is_relative_to(outer) for outer in kept):
            kept.append(path)
    return kept


def _tighten_named(
    path: Path, name: str, folder_fd: int | None, closed: list[tuple[Path, int]]
) -> None:
    # By name, never by opening it: a process that holds an SQLite connection to the store
    # loses the store's locks when it closes any descriptor of the file (POSIX record locks
    # go with the first close), and its next statement finds the database broken. The folder
    # is ours and already owner-only (walked from the top), so a link cannot be swapped in
    # between the look and the change.
    try:
        info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            logger.warning("cannot check who may open %s: %s", path, exc.strerror)
        return
    mode = stat.S_IMODE(info.st_mode)
    # A link's mode means nothing (its target is not ours to change); sockets and the like
    # are left as their servers made them.
    if not stat.S_ISREG(info.st_mode) or not mode & _OTHERS:
        return
    try:
        os.chmod(name, mode & ~_OTHERS, dir_fd=folder_fd)
    except OSError as exc:
        logger.warning("cannot make %s owner-only (mode %04o): %s", path, mode, exc.strerror)
        return
    closed.append((path, mode))


def _tighten_open(path: Path, fd: int, closed: list[tuple[Path, int]]) -> None:
    # On the open descriptor, so that what is changed is what was checked.
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not mode & _OTHERS:
        return
    try:
        os.fchmod(fd, mode & ~_OTHERS)
    except OSError as exc:
        logger.warning("cannot make %s owner-only (mode %04o): %s", path, mode, exc.strerror)
        return
    closed.append((path, mode))
