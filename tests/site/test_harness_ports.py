"""The test harness's engine port windows: one per test process on the machine at a time."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import procs


def test_a_window_held_by_one_test_process_is_never_drawn_by_another() -> None:
    """The SQLite and PostgreSQL passes run side by side: a window's ports are free when it is
    drawn, its engines start later, so a free check alone let two runs draw the same one."""
    low, high = procs.port_window()
    assert high - low + 1 == procs.PORT_WINDOW
    assert low not in {procs.port_window()[0] for _ in range(20)}  # nor again by this one
    other = (
        "import sys; from tests.harness import procs; "
        f"print(procs._hold({low}), procs.port_window()[0] != {low})"
    )

    def in_another_process() -> str:
        run = [sys.executable, "-c", other]
        done = subprocess.run(run, cwd=procs.REPO_ROOT, capture_output=True, text=True, check=True)
        return done.stdout

    assert in_another_process().split() == ["False", "True"]
    os.close(procs._held_windows.pop(low))  # as this process's end would
    assert in_another_process().split() == ["True", "True"]
