"""The weights janitor: removes model weights the control plane asks to remove, never while a
shard uses them, and reports each name as removed, absent or refused (with the reason).

Level-triggered like the rest of the agent: the names come with every desired state, and each
sweep judges every name afresh, so weights refused while a shard drains are removed by a later
sweep once it has stopped. Only paths inside the weights directory are ever touched.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from agents.engines import source_path, weights_overlap, weights_path
from agents.protocol.messages import DesiredShard, WeightsReport
from agents.protocol.vocabulary import WeightsState

logger = logging.getLogger(__name__)


def weights_users(target: Path, weights_dir: Path, shards: Iterable[DesiredShard]) -> list[int]:
    """The shards among ``shards`` whose weights lie in, or hold, ``target`` (no I/O beyond
    resolving the paths)."""
    return sorted(
        {
            spec.shard_id
            for spec in shards
            if weights_overlap(source_path(spec.source, weights_dir), target)
        }
    )


def judge(
    name: str,
    target: Path | None,
    *,
    exists: bool,
    users: list[int],
    previous: WeightsReport | None,
) -> WeightsReport | None:
    """The report for one name, or None when it should be removed now (pure)."""
    if target is None:
        return WeightsReport(name, WeightsState.REFUSED, "outside the weights directory")
    if not exists:
        if previous is not None and previous.state is WeightsState.REMOVED:
            return previous  # removed by an earlier sweep: keep saying so
        return WeightsReport(name, WeightsState.ABSENT, "not on this node")
    if users:
        return WeightsReport(
            name,
            WeightsState.REFUSED,
            f"refused: in use by shard(s) {', '.join(map(str, users))}; "
            "they must stop before their weights are removed",
        )
    return None


class WeightsJanitor:
    """One sweep at a time over the names the desired state lists; its reports are read by the
    agent's status. ``users`` says which shards use a path at the moment it is asked (the
    supervisor's live and wanted shards); ``changed`` is called when the reports change."""

    def __init__(
        self,
        weights_dir: Path,
        users: Callable[[Path], list[int]],
        changed: Callable[[], None],
    ) -> None:
        self.weights_dir = weights_dir
        self.users = users
        self.changed = changed
        self.reports: dict[str, WeightsReport] = {}
        self._task: asyncio.Task[None] | None = None

    def want_removed(self, names: tuple[str, ...]) -> None:
        """Sweep ``names`` unless a sweep is under way (the next desired state or lifecycle end
        brings another); no names: nothing to report any more."""
        if not names:
            self.reports.clear()
        elif self._task is None or self._task.done():
            self._task = asyncio.create_task(self._sweep(names))

    async def _sweep(self, names: tuple[str, ...]) -> None:
        reports: dict[str, WeightsReport] = {}
        for name in names:
            target = weights_path(name, self.weights_dir)
            report = judge(
                name,
                target,
                exists=target is not None and target.exists(),
                users=self.users(target) if target is not None else [],
                previous=self.reports.get(name),
            )
            if report is not None:
                if report.state is WeightsState.REFUSED and report != self.reports.get(name):
                    logger.warning("weights %s: %s", name, report.message)
                reports[name] = report
                continue
            assert target is not None
            try:
                await asyncio.to_thread(_remove_path, target)
            except OSError as exc:
                reports[name] = WeightsReport(name, WeightsState.REFUSED, f"cannot remove: {exc}")
                logger.error("weights %s: cannot remove: %s", name, exc)
            else:
                logger.info("weights %s removed (%s)", name, target)
                reports[name] = WeightsReport(name, WeightsState.REMOVED, str(target))
        if reports != self.reports:
            self.reports = reports
            self.changed()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _remove_path(target: Path) -> None:
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        target.unlink()
