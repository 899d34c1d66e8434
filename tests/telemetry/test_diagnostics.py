"""Each process answers for itself on its channel (``telemetry.diagnostics``): asked of a real
process doing known things (``tests.harness.diagnosed``), the answers show them: its busy
thread in a CPU profile, its waiting task's await chain, its leak's growth, its stalled event
loop, the file and the connection it holds. The channel lives in a folder deeper than a Unix
socket's address may be, as a var folder under a long home may be."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from telemetry import diagnostics, reports
from tests.harness.diagnosed import STALL_S, Diagnosed, started
from tests.harness.waits import wait_until


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    deep = tmp_path_factory.mktemp("diagnostics") / ("a-var-folder-with-a-long-name-" * 4)
    assert len(os.fsencode(deep / "4194304.sock")) > 108  # past sockaddr_un's limit
    return deep / "diagnostics"


@pytest.fixture(scope="module")
def diagnosed(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Diagnosed]:
    with started(folder, tmp_path_factory.mktemp("diagnosed")) as process:
        yield process


def only(answers: list[dict[str, Any]], pid: int) -> dict[str, Any]:
    (answer,) = [a for a in answers if a.get("pid") == pid]
    assert "answer" in answer, answer
    return dict(answer["answer"])


def test_the_channel_is_a_socket_only_its_owner_may_open(
    folder: Path, diagnosed: Diagnosed
) -> None:
    path = folder / f"{diagnosed.proc.pid}.sock"
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_the_stacks_show_every_thread_and_the_await_chain_of_every_task(
    folder: Path, diagnosed: Diagnosed
) -> None:
    answers = diagnostics.gather(folder, "stacks", pids=[diagnosed.proc.pid])
    snapshot = only(answers, diagnosed.proc.pid)
    threads = {thread["name"]: thread for thread in snapshot["threads"]}
    assert {"MainThread", "busy", "llmgw diagnostics channel"} <= set(threads)
    busy = [frame["function"] for frame in threads["busy"]["frames"]]
    assert "spin_in_a_known_function" in " ".join(busy)
    (task,) = [task for task in snapshot["tasks"] if task["name"] == "known task"]
    chain = [frame["function"] for frame in task["frames"]]
    # The coroutine, and what it awaits in turn, innermost last.
    assert chain[:2] == ["wait_in_a_known_coroutine", "sleep"]
    assert task["awaiting"] == "FutureIter"  # the Future asyncio.sleep waits on
    text = reports.stacks(answers)
    assert f"=== test pid {diagnosed.proc.pid}" in text
    assert "Task known task (wait_in_a_known_coroutine)" in text
    assert "await asyncio.sleep(3600)" in text  # the source line, as a traceback shows it


def test_a_cpu_profile_of_one_second_finds_the_busy_thread_in_its_function(
    folder: Path, diagnosed: Diagnosed
) -> None:
    answers = diagnostics.gather(folder, "profile", {"seconds": 1}, pids=[diagnosed.proc.pid])
    profile = only(answers, diagnosed.proc.pid)
    assert profile["mode"] == "cpu"
    assert profile["samples"] > 10
    busy = {stack: weight for stack, weight in profile["folded"].items() if "busy" in stack}
    assert any("spin_in_a_known_function" in stack for stack in busy)
    # Waiting weighs nothing in a CPU profile: the task's sleep and the channel are absent.
    assert not any("wait_in_a_known_coroutine" in stack for stack in profile["folded"])
    assert not any("llmgw diagnostics" in stack for stack in profile["folded"])
    svg = reports.flame_graph(answers, mode="cpu", seconds=1)
    assert svg.startswith("<?xml") and "spin_in_a_known_function" in svg
    assert f"test {diagnosed.proc.pid}" in svg  # each process is a tower of its own


def test_a_wall_profile_shows_where_the_threads_wait_too(
    folder: Path, diagnosed: Diagnosed
) -> None:
    answers = diagnostics.gather(
        folder, "profile", {"seconds": 0.5, "mode": "wall"}, pids=[diagnosed.proc.pid]
    )
    folded = only(answers, diagnosed.proc.pid)["folded"]
    assert any(stack.startswith("MainThread;") for stack in folded)
    assert any("leak_a_known_allocation" in stack for stack in folded)


def test_a_second_profile_at_the_same_time_is_refused(folder: Path, diagnosed: Diagnosed) -> None:
    pid = diagnosed.proc.pid
    path = folder / f"{pid}.sock"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(diagnostics.ask, path, "profile", {"seconds": 2}, timeout=60)
        wait_until(
            lambda: only(diagnostics.gather(folder, "info", pids=[pid]), pid)["profiling"],
            what="the first profile under way",
        )
        second = diagnostics.ask(path, "profile", {"seconds": 0.1}, timeout=60)
        assert second["error"] == "a profile of this process is already being taken"
        assert first.result()["answer"]["samples"] > 0
    assert only(diagnostics.gather(folder, "info", pids=[pid]), pid)["profiling"] is False


def test_tracemalloc_switched_on_shows_the_leak_growing_from_its_line(
    folder: Path, diagnosed: Diagnosed
) -> None:
    pid = diagnosed.proc.pid
    assert only(diagnostics.gather(folder, "heap", pids=[pid]), pid)["tracing"] is False
    assert only(diagnostics.gather(folder, "heap", {"action": "start"}, pids=[pid]), pid)["tracing"]

    def grown() -> dict[str, Any] | None:
        report = only(diagnostics.gather(folder, "heap", pids=[pid]), pid)
        top = report["growth"][0] if report["growth"] else None
        return report if top and top["size_diff"] > 200 * 1024 else None

    report = wait_until(grown, what="200 KiB of growth")
    top = report["growth"][0]
    # Allocated by the leaked object's constructor, called from the leaking line.
    innermost = top["frames"][-1]
    assert innermost["file"].endswith("tests/harness/diagnosed.py")
    assert innermost["code"] == "self.payload = bytes(1024)  # the leaked bytes"
    assert "kept.append(Leaked())  # the leaking line" in [f["code"] for f in top["frames"]]
    assert top["count_diff"] > 0
    text = reports.heap(diagnostics.gather(folder, "heap", pids=[pid]), depth=2)
    assert "growth since the baseline:" in text
    assert "self.payload = bytes(1024)" in text and "the leaking line" in text

    # A new baseline: what grew before it is no longer growth. The old one has aged (reported
    # in tenths of a second), so the new one is younger, however slowly the machine runs.
    def baseline_aged() -> float | None:
        age = only(diagnostics.gather(folder, "heap", pids=[pid]), pid)["baseline_age_s"]
        return float(age) if age >= 0.2 else None

    aged = wait_until(baseline_aged, what="the baseline to age")
    rebased = only(diagnostics.gather(folder, "heap", {"action": "rebase"}, pids=[pid]), pid)
    assert rebased["baseline_age_s"] < aged
    stopped = only(diagnostics.gather(folder, "heap", {"action": "stop"}, pids=[pid]), pid)
    assert stopped["tracing"] is False
    assert only(diagnostics.gather(folder, "heap", pids=[pid]), pid)["growth"] == []


def test_objects_by_type_and_the_collectors_statistics(folder: Path, diagnosed: Diagnosed) -> None:
    pid = diagnosed.proc.pid
    report = only(diagnostics.gather(folder, "objects", {"top": 200}, pids=[pid]), pid)
    counts = {row["type"]: row["count"] for row in report["types"]}
    assert counts.get("__main__.Leaked", 0) > 100
    assert report["tracked"] >= sum(counts.values())
    collector = report["gc"]
    assert collector["enabled"] is True
    assert len(collector["generations"]) == 3
    assert collector["generations"][0]["collections"] > 0


def test_info_tells_memory_threads_loop_lag_and_connections(
    folder: Path, diagnosed: Diagnosed
) -> None:
    pid = diagnosed.proc.pid

    def stalled() -> dict[str, Any] | None:
        info = only(diagnostics.gather(folder, "info", pids=[pid]), pid)
        lag = info["loop_lag"]
        return info if lag["max_ms"] is not None and lag["max_ms"] >= STALL_S * 900 else None

    info = wait_until(stalled, what="the stall seen as lag")
    assert info["memory"]["rss_bytes"] > 10 * 2**20
    assert info["memory"]["rss_peak_bytes"] >= info["memory"]["rss_bytes"]
    assert info["threads"]["python"] >= 4  # main, busy, leak, the channel (and its request)
    assert info["threads"]["os"] >= info["threads"]["python"]
    counted = {c["name"]: c for c in info["connections"]}
    assert counted["store"] == {"name": "store", "where": str(diagnosed.held), "open": 1}
    assert counted["redis"]["open"] == 1
    assert counted["redis"]["where"] == f"127.0.0.1:{diagnosed.port}"
    table = reports.processes(diagnostics.gather(folder, "info", pids=[pid])).splitlines()
    assert table[0].split()[:2] == ["process", "pid"]
    (row,) = [line for line in table if line.startswith("test ")]
    assert row.split()[1] == str(pid)
    assert row.endswith("store 1, redis 1")


def test_an_unknown_diagnostic_is_refused_by_name(folder: Path, diagnosed: Diagnosed) -> None:
    (answer,) = diagnostics.gather(folder, "secrets", pids=[diagnosed.proc.pid])
    assert answer["error"] == "no such diagnostic: 'secrets'"
    (answer,) = diagnostics.gather(folder, "profile", {"seconds": 1000}, pids=[diagnosed.proc.pid])
    assert "seconds must be" in answer["error"]


def test_a_killed_process_is_forgotten_and_its_socket_removed(
    folder: Path, tmp_path: Path, diagnosed: Diagnosed
) -> None:
    with started(folder, tmp_path, role="doomed") as doomed:
        path = folder / f"{doomed.proc.pid}.sock"
        pids = {a["pid"] for a in diagnostics.gather(folder, "info")}
        assert {diagnosed.proc.pid, doomed.proc.pid} <= pids
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        assert path.exists()  # SIGKILL left it
        pids = {a["pid"] for a in diagnostics.gather(folder, "info")}
    assert doomed.proc.pid not in pids
    assert diagnosed.proc.pid in pids
    assert not path.exists()


def test_a_stopped_process_removes_its_socket(folder: Path, tmp_path: Path) -> None:
    with started(folder, tmp_path, role="brief") as brief:
        path = folder / f"{brief.proc.pid}.sock"
        assert path.exists()
    assert brief.proc.popen is not None and brief.proc.popen.returncode is not None
    assert not path.exists()
