"""The state file: what an agent leaves for the next agent on its node.

It holds the highest leader epoch seen (so a deposed leader is still refused after a restart)
and every live engine with its desired shard and :class:`~agents.processes.ProcessMark`, so
the next agent adopts engines left running instead of starting duplicates. Written atomically
(a temporary file, then a rename); a file that cannot be read is ignored, entry by entry.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from agents.processes import ProcessMark
from agents.protocol.messages import DesiredShard

logger = logging.getLogger(__name__)

STATE_FILE: Final = "shards.json"


@dataclass(frozen=True)
class SavedShard:
    spec: DesiredShard
    mark: ProcessMark


@dataclass(frozen=True)
class SavedState:
    highest_epoch: int = 0
    shards: tuple[SavedShard, ...] = ()


def save(path: Path, highest_epoch: int, shards: Sequence[SavedShard]) -> None:
    """Replace the state file; a failure is logged, never raised (the shards keep running)."""
    data = {
        "highest_epoch": highest_epoch,
        "shards": [
            {"spec": s.spec.to_dict(), "pid": s.mark.pid, "start": s.mark.start} for s in shards
        ],
    }
    tmp = path.with_suffix(".tmp")
    try:
        # Owner-only: the specs carry the engines' API keys.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("cannot write %s: %s", path, exc)


def load(path: Path) -> SavedState:
    """What a previous agent left; nothing when there is no file or it cannot be read."""
    try:
        data: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return SavedState()
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return SavedState()
    if not isinstance(data, dict):
        return SavedState()
    epoch = data.get("highest_epoch")
    shards: list[SavedShard] = []
    for entry in data.get("shards") or []:
        try:
            spec = DesiredShard.from_dict(entry.get("spec"))
            mark = ProcessMark(int(entry["pid"]), str(entry["start"]))
        except Exception as exc:
            logger.warning("ignoring a shard in %s: %s", path, exc)
            continue
        shards.append(SavedShard(spec, mark))
    return SavedState(
        highest_epoch=epoch if isinstance(epoch, int) and epoch >= 0 else 0,
        shards=tuple(shards),
    )
