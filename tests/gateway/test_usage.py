"""The usage pipeline's parts: rows stored once, journals replayed, dead processes swept."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from gateway.ledger import recorder as pipeline
from gateway.ledger import usage
from gateway.ledger.usage import Usage
from gateway.models import UsageRecord
from tests.harness.live import close_db_thread
from tests.harness.modes import assert_owner_only, umask


@pytest.fixture(autouse=True)
def _db_thread_closed() -> Iterator[None]:
    yield
    close_db_thread()


pytestmark = pytest.mark.django_db(transaction=True)


def counted(metric: str) -> float:
    return REGISTRY.get_sample_value(f"{metric}_total") or 0.0


def record(request_id: str, **fields: Any) -> Usage:
    return Usage(request_id, None, None, "m", "chat", time.time(), **fields)


def test_storing_the_same_rows_twice_keeps_one_of_each() -> None:
    rows = [record("r1", completion_tokens=3), record("r2")]
    usage.store_rows(rows)
    usage.store_rows(rows)
    assert sorted(UsageRecord.objects.values_list("request_id", "completion_tokens")) == [
        ("r1", 3),
        ("r2", 0),
    ]


def test_rows_of_a_deleted_key_are_kept_without_the_key(django_user_model: Any) -> None:
    from gateway.identity import keys

    django_user_model.objects.create_user(username="u")
    issued = keys.issue("u")
    stale = record("r1")
    stale.api_key_id, stale.user_id = issued.api_key.pk, issued.api_key.user_id
    issued.api_key.delete()
    usage.store_rows([stale, record("r2")])
    row = UsageRecord.objects.get(request_id="r1")
    assert row.api_key_id is None and row.user_id is not None


def test_a_model_name_with_a_nul_byte_is_stored_and_holds_back_no_other_row() -> None:
    """The model name is the client's string; PostgreSQL text cannot hold NUL."""
    usage.store_rows([record("r1"), Usage("r2", None, None, "m\x00x", "chat", time.time())])
    assert dict(UsageRecord.objects.values_list("request_id", "model")) == {
        "r1": "m",
        "r2": "m\ufffdx",
    }


def journal_name(pid: int) -> str:
    """A journal's file name as a web process writing to the test store names it."""
    return f"{usage.store_id()}.{pid}-aa.journal"


def write_journal(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(lines))


def test_journal_lines_read_back_whatever_model_name_a_client_sent(tmp_path: Path) -> None:
    # A lone surrogate is valid JSON to Python but not UTF-8: it must not cost the row.
    names = ["m", "模型-ü", "bad\ud800name", 'quote"and\\slash']
    path = tmp_path / "1-a.journal"
    write_journal(
        path,
        [
            usage.journal_line("d", Usage(f"r{i}", None, None, name, "chat", 1.0))
            for i, name in enumerate(names)
        ],
    )
    assert [row.model for row in usage.read_journal(path)] == names


def test_a_dead_processs_journal_is_replayed_and_open_requests_closed(tmp_path: Path) -> None:
    done = record("done-1", status=200, completion_tokens=5, finish_reason="stop")
    started = record("open-1", upstream="replica:3", stream=True)
    finished_start = record("done-1")
    write_journal(
        tmp_path / journal_name(111),
        [
            usage.journal_line("s", finished_start),
            usage.journal_line("s", started),
            usage.journal_line("d", done),
            b'{"t":"d","request_id":"cut-sho',  # the last line of a process killed mid-write
        ],
    )
    assert usage.sweep(tmp_path) == 2
    rows = {
        r.request_id: r for r in UsageRecord.objects.filter(request_id__in=["done-1", "open-1"])
    }
    assert rows["done-1"].finish_reason == "stop" and rows["done-1"].completion_tokens == 5
    assert rows["open-1"].finish_reason == "interrupted" and rows["open-1"].upstream == "replica:3"
    assert not list(tmp_path.glob("*.journal"))


def test_a_live_processs_journal_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / journal_name(222)
    write_journal(path, [usage.journal_line("s", record("busy"))])
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as its owner holds it while alive
    try:
        assert usage.sweep(tmp_path) == 0
        assert path.exists() and not UsageRecord.objects.filter(request_id="busy").exists()
    finally:
        os.close(fd)
    assert usage.sweep(tmp_path) == 1


async def test_the_recorder_writes_in_batches_and_rotates_its_journal(
    tmp_path: Path, settings: Any
) -> None:
    from asgiref.sync import sync_to_async

    settings.LLMGW_USAGE_JOURNAL_DIR = tmp_path
    recorder = pipeline.Recorder()
    in_flight = record("still-running")
    recorder.start(in_flight)
    for i in range(5):
        recorder.start(record(f"r{i}"))
        recorder.finish(record(f"r{i}", status=200))
    assert await recorder.flush() == 5
    mine = UsageRecord.objects.filter(request_id__in=[f"r{i}" for i in range(5)])
    assert await sync_to_async(mine.count)() == 5
    first = recorder._path
    recorder._segment_started -= pipeline.SEGMENT_SECONDS  # an old segment: rotate after a flush
    recorder.finish(record("r5", status=200))
    await recorder.flush()
    assert recorder._path != first and first is not None and not first.exists()
    # The request still in flight was carried over into the new segment.
    assert recorder._path is not None
    assert b"still-running" in recorder._path.read_bytes()
    await sync_to_async(recorder.close)()  # as at exit: open requests become interrupted rows
    row = await sync_to_async(UsageRecord.objects.get)(request_id="still-running")
    assert row.finish_reason == "interrupted"
    assert not list(tmp_path.glob("*.journal"))


# --------------------------------------------------------------------------- hostile numbers


def test_counts_no_row_can_hold_are_clamped_and_every_row_is_stored() -> None:
    """Failure 4: -5000 and 10**23 prompt tokens used to fail the whole batch, forever."""
    rows = [
        record("neg", prompt_tokens=-5000, completion_tokens=3),
        record("huge", prompt_tokens=10**23, cached_tokens=10**30),
        record("fine", prompt_tokens=7),
    ]
    assert usage.store_rows(rows) == 3
    assert dict(UsageRecord.objects.values_list("request_id", "prompt_tokens")) == {
        "neg": 0,
        "huge": 2**31 - 1,
        "fine": 7,
    }
    assert UsageRecord.objects.get(request_id="huge").cached_tokens == 2**31 - 1


def test_clamped_counts_are_counted_in_the_metric_and_named_in_one_event_a_minute() -> None:
    recorder = pipeline.Recorder()
    before = counted("llmgw_usage_clamped")
    clamped = (("prompt_tokens", "-5000"), ("completion_tokens", str(10**23)))
    for request_id in ("a", "b"):
        recorder.note_clamped(record(request_id, upstream="endpoint:broken"), clamped)
    assert counted("llmgw_usage_clamped") == before + 4
    # Queued for the writer with the rows: one for the two requests, naming what was reported.
    ((subject, message, data),) = recorder.events
    assert subject == "upstream/endpoint:broken" and "prompt_tokens=-5000" in message
    assert data["request_id"] == "a"


def test_a_row_the_store_refuses_is_dead_lettered_and_holds_back_no_other(
    tmp_path: Path,
) -> None:
    from control.models import Event

    refused = [
        record("bad-status", status=-1),  # the store's CHECK refuses it
        Usage("bad-time", None, None, "m", "chat", float("inf")),  # no datetime holds it
    ]
    rows = [record("ok-1"), *refused, record("ok-2")]
    dead_letters = counted("llmgw_usage_dead_letters")
    assert usage.store_rows(rows, tmp_path) == 4
    assert counted("llmgw_usage_dead_letters") == dead_letters + 2
    assert set(UsageRecord.objects.values_list("request_id", flat=True)) == {"ok-1", "ok-2"}
    dead = tmp_path / usage.DEAD_LETTER_DIR / f"{usage.store_id()}.jsonl"
    lines = [json.loads(line) for line in dead.read_bytes().splitlines()]
    assert [line["request_id"] for line in lines] == ["bad-status", "bad-time"]
    assert all(line["error"] for line in lines)
    event = Event.objects.get(subject__startswith="usage/")
    assert "dead-letter" in event.message and event.data["request_ids"] == [
        "bad-status",
        "bad-time",
    ]


async def test_the_recorder_keeps_recording_after_a_row_the_store_refuses(
    tmp_path: Path, settings: Any
) -> None:
    from asgiref.sync import sync_to_async

    settings.LLMGW_USAGE_JOURNAL_DIR = tmp_path
    recorder = pipeline.Recorder()
    recorder.finish(record("poison", status=-1))
    recorder.finish(record("before", status=200))
    assert await recorder.flush() == 2
    recorder.finish(record("after", status=200))
    assert await recorder.flush() == 1
    stored = await sync_to_async(
        lambda: set(UsageRecord.objects.values_list("request_id", flat=True))
    )()
    assert stored == {"before", "after"} and recorder.queue == []
    await sync_to_async(recorder.close)()


def test_replay_of_a_journal_with_impossible_numbers_finishes_and_stores_the_rest(
    tmp_path: Path,
) -> None:
    """Failure 4: the replay at start-up died with OverflowError until files were deleted."""
    write_journal(
        tmp_path / journal_name(333),
        [
            usage.journal_line("d", record("overflow", status=200, prompt_tokens=10**23)),
            usage.journal_line("d", record("refused", status=-1)),
            usage.journal_line("d", record("plain", status=200, completion_tokens=2)),
        ],
    )
    assert usage.sweep(tmp_path) == 3
    assert dict(UsageRecord.objects.values_list("request_id", "prompt_tokens")) == {
        "overflow": 2**31 - 1,
        "plain": 0,
    }
    assert not list(tmp_path.glob("*.journal"))
    assert (tmp_path / usage.DEAD_LETTER_DIR / f"{usage.store_id()}.jsonl").exists()


def test_a_journal_written_for_another_store_is_not_replayed_into_this_one(
    tmp_path: Path,
) -> None:
    other = tmp_path / "0123456789ab.444-aa.journal"
    write_journal(other, [usage.journal_line("d", record("elsewhere", status=200))])
    assert usage.sweep(tmp_path) == 0
    assert other.exists() and not UsageRecord.objects.filter(request_id="elsewhere").exists()


def test_replay_command_never_fails_start_up_when_the_store_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.core.management import call_command
    from django.db import OperationalError

    write_journal(tmp_path / journal_name(555), [usage.journal_line("d", record("later"))])

    def down(*args: Any, **kwargs: Any) -> int:
        raise OperationalError("the store is down")

    monkeypatch.setattr(usage, "store_rows", down)
    call_command("replay_usage", dir=tmp_path)  # no exception: start-up goes on
    assert (tmp_path / journal_name(555)).exists()  # kept for the next sweep


def test_journals_and_dead_letters_are_owner_only_whatever_the_umask(
    tmp_path: Path, settings: Any
) -> None:
    """What a request cost, and who made it, is read by no other local user, even when the
    web process has a umask that lets everyone read and write (000)."""
    folder = tmp_path / "usage"
    settings.LLMGW_USAGE_JOURNAL_DIR = folder
    recorder = pipeline.Recorder()
    with umask(0):
        usage.store_rows([record("refused", status=-1)])  # the dead letters' folder first
        recorder.start(record("in-flight"))
    assert recorder._path is not None and recorder._path.parent == folder
    assert (folder / usage.DEAD_LETTER_DIR / f"{usage.store_id()}.jsonl").exists()
    assert_owner_only(folder)
    recorder.close()
