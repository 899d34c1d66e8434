"""The embedded default's broker never delivers half a message.

kombu's filesystem transport, as shipped, writes a message into its final name while the
reader may already take it: the worker then dies on ``JSONDecodeError``. The transport of
``llmgw_site.broker`` writes aside and renames. Here a producer and a consumer share a folder
through the real kombu connection, with messages large enough that a torn read would be
likely (the test that finds a torn read, if there is one); then the real beat and worker run
for 50 ticks with both cores kept busy (that one shows the worker outlives a loaded machine).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from kombu.connection import Connection

from llmgw_site import broker
from llmgw_site.management.commands.run import celery_argv
from tests.harness.modes import mode, umask
from tests.harness.procs import Proc
from tests.harness.store import child_env
from tests.harness.waits import wait_until

MESSAGES = 300
TICKS = 50  # at one tick a second, about a minute under load


def options(folder: Path) -> dict[str, Any]:
    (folder / "processed").mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "processed_folder": str(folder / "processed"),
        "control_folder": str(folder / "bindings"),
        "store_processed": False,
        "polling_interval": 0.001,
    }


def test_a_consumer_racing_a_producer_reads_every_message_whole(tmp_path: Path) -> None:
    import llmgw_site.celery  # noqa: F401  (registers the transport's scheme)

    body = "x" * 2_000_000  # long enough to take many writes, so a torn read would show
    url = f"{broker.ALIAS}://localhost/"
    received: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def consume() -> None:
        with Connection(url, transport_options=options(tmp_path)) as conn:
            queue = conn.SimpleQueue("race")
            try:
                while len(received) < MESSAGES and not done.is_set():
                    try:
                        message = queue.get(block=True, timeout=0.05)
                    except queue.Empty:
                        continue
                    except Exception as exc:  # a torn message fails to decode here
                        errors.append(exc)
                        return
                    received.append(int(message.payload["n"]))
                    assert len(message.payload["body"]) == len(body)
                    message.ack()
            finally:
                queue.close()

    consumer = threading.Thread(target=consume)
    consumer.start()
    with Connection(url, transport_options=options(tmp_path)) as conn:
        queue = conn.SimpleQueue("race")
        for n in range(MESSAGES):
            queue.put({"n": n, "body": body})
        queue.close()
    consumer.join(120)
    done.set()
    assert not errors, f"a message was read torn: {errors[0]!r}"
    assert sorted(received) == list(range(MESSAGES))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary left"


def test_a_message_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    """A task's arguments are read by no other local user, even when the process sending it
    has a umask that lets everyone read and write (000)."""
    with umask(0):
        broker.write_atomically(str(tmp_path), "1_a.celery.msg", b"{}")
    assert mode(tmp_path / "1_a.celery.msg") == 0o600


def lease_renewals() -> int | None:
    """The reconciler lease's expiry (ms on the database clock), which every tick renews."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT expires_at_ms FROM control_lease WHERE name = 'reconciler'")
        row = cursor.fetchone()
    return int(row[0]) if row else None


@pytest.mark.django_db(transaction=True)
@pytest.mark.e2e
@pytest.mark.timeout(TICKS * 10 + 120)
def test_beat_and_worker_on_the_embedded_broker_tick_steadily_with_both_cores_busy(
    tmp_path: Path,
) -> None:
    if connection.vendor != "sqlite":
        pytest.skip("the embedded broker is the embedded default's, which runs on SQLite")
    interval = 1.0
    var = tmp_path / "var"
    env = child_env(LLMGW_VAR_DIR=str(var), LLMGW_RECONCILE_INTERVAL=str(interval))
    env.pop("REDIS_URL", None)
    worker = Proc("worker", celery_argv("worker", "--pool", "solo"), tmp_path, env).start()
    schedule = str(var / "beat-schedule")
    beat = Proc("beat", celery_argv("beat", "--schedule", schedule), tmp_path, env).start()
    # At the lowest priority: the cores stay busy whenever the worker and beat would leave them
    # idle, without taking the CPU that the rest of a parallel suite needs.
    burn = "import os\nos.nice(19)\nwhile True: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    try:
        wait_until(lease_renewals, what="a first tick", logs=[worker, beat])
        stamps: list[int] = []

        def ticked(count: int) -> bool:
            assert worker.running(), f"the worker died:\n{worker.tail()}"
            stamp = lease_renewals()
            if stamp is not None and (not stamps or stamp != stamps[-1]):
                stamps.append(stamp)
            return len(stamps) >= count

        # A tick may be dropped (its `expires` passed while the cores were busy); what must
        # not happen is a worker dying on a torn message, which would end the ticks for good.
        wait_until(lambda: ticked(TICKS), what=f"{TICKS} ticks", timeout=TICKS * 10, logs=[worker])
        assert worker.running() and beat.running()
        assert "JSONDecodeError" not in worker.log(), worker.tail()
        gaps = [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]
        # Nor are two ticks in a row dropped: no gap between renewals (on the database's
        # clock) spans more than one missed interval.
        assert max(gaps) < 2 * interval + 0.5, f"longest gap between ticks {max(gaps):.2f}s"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        beat.stop()
        worker.stop()
