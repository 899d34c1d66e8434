"""The launcher's stop (``manage.py run``, ``llmgw_site.launcher``): SIGTERM to every child,
then the shutdown grace plus a margin before anything is killed, so a web process draining
its requests in flight is not cut short by its own launcher."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from llmgw_site import launcher
from tests.harness.waits import wait_until

# A child that takes ``delay`` seconds to stop after SIGTERM (a negative delay: never stops
# on SIGTERM); it touches ``ready`` once its handler is in place.
CHILD = """
import signal, sys, time
from pathlib import Path
delay = float(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.monotonic()))
Path(sys.argv[1]).touch()
while not stop or delay < 0 or time.monotonic() - stop[0] < delay:
    time.sleep(0.02)
"""


def start_child(tmp_path: Path, delay: float) -> launcher.Child:
    ready = tmp_path / "ready"
    argv = [sys.executable, "-c", CHILD, str(ready), str(delay)]
    child = launcher.Child("slow-stopper", argv, dict(os.environ))
    child.start()
    wait_until(ready.exists, what="the child's SIGTERM handler", timeout=30)
    return child


def test_a_child_that_stops_within_the_grace_is_waited_for_not_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "STOP_MARGIN_SECONDS", 1.0)
    child = start_child(tmp_path, delay=1.5)  # past the grace, within the grace plus the margin
    began = time.monotonic()
    launcher.Supervisor([child], stop_grace=1.0).stop_all()
    assert child.process is not None
    assert child.process.returncode == 0, "it was killed before the grace plus the margin"
    assert time.monotonic() - began >= 1.5


def test_a_child_still_running_after_the_grace_and_margin_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "STOP_MARGIN_SECONDS", 0.5)
    child = start_child(tmp_path, delay=-1)  # ignores SIGTERM
    began = time.monotonic()
    launcher.Supervisor([child], stop_grace=1.0).stop_all()
    waited = time.monotonic() - began
    assert child.process is not None
    assert child.process.returncode == -signal.SIGKILL
    assert 1.5 <= waited < 10, f"killed after {waited:.1f}s, not after the grace plus the margin"
