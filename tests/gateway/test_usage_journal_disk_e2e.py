"""The usage journal's disk is full, end to end: a live web process whose journal folder is a
tmpfs of 1 MiB, filled to the last byte under traffic, then given space again.

What must hold ([U17], README "Usage"): requests are served as usual;
the web process says so (``llmgw_usage_journal_unwritable`` is 1, ``llmgw_usage_journal_errors``
counts, an Event and an error line name the journal); every request still gets exactly one
usage row, written to the store without the journal, and nothing journaled before is lost;
once there is space again the journal is written again, by itself.

The disk is a real tmpfs, so the web process gets a real ENOSPC (a short write first, then the
error) from the kernel: mounting one takes root, which CI has. Elsewhere the test is skipped,
saying why.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from control.models import Event
from gateway.models import ApiKey, UsageRecord
from tests.harness.factories import make_key, serve_model
from tests.harness.live import (
    Stack,
    engine_requests,
    gateway_stack,
    http,
    journaled,
    routes,
)
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

METRICS_TOKEN = "journal-disk-metrics"
SLOW = {"sim": {"itl_ms": 150, "output_tokens": 20}}  # a stream of about three seconds


@pytest.fixture
def journal_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 1 MiB for the usage journals (unmounted at the end)."""
    disk = tmp_path / "journal-disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield disk / "usage"
    finally:
        if subprocess.run(["umount", str(disk)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def stack(tmp_path: Path, journal_disk: Path) -> Iterator[Stack]:
    settings = {"LLMGW_USAGE_JOURNAL_DIR": str(journal_disk), "LLMGW_METRICS_TOKEN": METRICS_TOKEN}
    with gateway_stack(tmp_path, ["m"], engines=1, settings=lambda _: settings) as stack:
        yield stack


def fill(disk: Path) -> Path:
    """Write a file on ``disk`` until the kernel says it is full; the file."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def metric(stack: Stack, name: str) -> float:
    """A sample of the web process's ``/metrics``, summed over its labels (0 if absent)."""
    status, _, body = http(
        "GET", stack.web.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
    )
    assert status == 200, body
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", body.decode(), re.MULTILINE)
    return sum(float(value) for value in found)


def chat(client: openai.OpenAI, **extra: object) -> str:
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], extra_body=extra or None
    )
    return reply.choices[0].message.content or ""


def stream(client: openai.OpenAI, **extra: object) -> str:
    chunks = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        extra_body=extra or None,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def rows(api_key: ApiKey) -> dict[str, int]:
    """Request id -> how many usage rows it has."""
    ids = list(UsageRecord.objects.filter(api_key=api_key).values_list("request_id", flat=True))
    return {rid: ids.count(rid) for rid in ids}


def test_a_full_journal_disk_keeps_serving_says_so_and_resumes_by_itself(
    stack: Stack, journal_disk: Path
) -> None:
    """[U17] Five requests, three streams in flight, then the disk fills: fifteen more are
    served, the gauge, the counter, an Event and an error line say so, and all 23 have one row
    each (none interrupted); space again: the journal is written again by itself."""
    key, api_key = make_key()
    serve_model("m", [stack.engines[0].port])
    wait_until(lambda: routes(stack.web, key, "m"), what="the web process to route m")
    client = openai.OpenAI(base_url=stack.web.url + "/v1", api_key=key, max_retries=0, timeout=60)

    # Before: five requests, journaled and stored.
    assert all(chat(client) for _ in range(5))
    wait_until(lambda: len(rows(api_key)) == 5, what="the first five rows")
    before = journaled(journal_disk.parent) or set()

    # Streams in flight when the disk fills: their start lines are in the journal already.
    with ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(stream, client, **SLOW) for _ in range(3)]
        wait_until(
            lambda: engine_requests(stack.engines[0], running=True) >= 8,
            what="three streams at the engine",
        )
        filler = fill(journal_disk.parent)
        full = [chat(client) for _ in range(10)] + [stream(client) for _ in range(5)]
        assert all(full), full
        assert all(f.result() for f in in_flight)

    # It says so: the gauge, the counter, an Event, an error line.
    wait_until(lambda: metric(stack, "llmgw_usage_journal_unwritable") == 1, what="the gauge")
    assert metric(stack, "llmgw_usage_journal_errors_total") >= 1
    wait_until(
        lambda: Event.objects.filter(subject="usage/journal", message__contains="full").exists(),
        what="an Event saying the journal's disk is full",
    )
    assert re.search(r" ERROR \S+ .*usage journal .*cannot be written", stack.web.log())
    assert "Traceback" not in stack.web.log(), "nothing failed with the journal"
    # Every request has exactly one row, stored without the journal.
    wait_until(lambda: len(rows(api_key)) == 23, what="a row for each of the 23 requests")
    assert set(rows(api_key).values()) == {1}
    assert not UsageRecord.objects.filter(api_key=api_key, finish_reason="interrupted").exists()

    # Space again: the journal is written again by itself, and says so.
    filler.unlink()
    wait_until(lambda: metric(stack, "llmgw_usage_journal_unwritable") == 0, what="writable")
    wait_until(
        lambda: Event.objects.filter(subject="usage/journal", message__contains="again").exists(),
        what="an Event saying the journal is written again",
    )
    assert all(chat(client) for _ in range(5))
    wait_until(
        lambda: len((journaled(journal_disk.parent) or set()) - before) >= 5,
        what="the new requests in the journal",
    )
    wait_until(lambda: len(rows(api_key)) == 28, what="a row for each of the 28 requests")
    assert set(rows(api_key).values()) == {1}
    assert engine_requests(stack.engines[0]) == 28
