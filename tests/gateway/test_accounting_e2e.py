"""Usage you can bill by, end to end: live web process, live ``sim`` engines that behave the
way real ones do (no usage in streams, streams cut clean, nonsense counts), the official
``openai`` client. Each test here failed on the gateway before its fix (issue: honest usage)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from control.models import Event
from gateway.models import UsageRecord
from tests.harness.factories import make_key, serve_model
from tests.harness.live import (
    engine_requests,
    http,
    start_sim,
    start_web,
    stop_checked,
    wait_for_rows,
)
from tests.harness.procs import Proc
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# With no max-token field, a limited key reserves (and binds the engine to) this many tokens.
DEFAULT_MAX = 4


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    """A web process, a sim with vLLM's /tokenize and one without."""
    # Each process is stopped even when a later one fails to start or a check at the end
    # fails: none outlives the test.
    with contextlib.ExitStack() as stack:
        sim = start_sim(tmp_path, ["acc"])
        stack.callback(sim.stop)
        bare = start_sim(tmp_path, ["bare"], "--no-tokenize")
        stack.callback(bare.stop)
        web = start_web(tmp_path / "var", LLMGW_DEFAULT_MAX_TOKENS=str(DEFAULT_MAX))
        stack.callback(stop_checked, web)
        yield web, sim, bare


def client(web: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=60)


def serve(web: Proc, key: str, name: str, port: int) -> None:
    serve_model(name, [port])
    wait_until(
        lambda: name in [m.id for m in client(web, key).models.list().data],
        what=f"the web process routes {name}",
    )


def chat_body(model: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "one two three"}], **extra}
    ).encode()


# --------------------------------------------------------------------------- failure 3


def test_the_largest_max_token_field_is_reserved_whatever_the_order(
    live: tuple[Proc, Proc, Proc],
) -> None:
    """`{"max_tokens": 100000, "max_completion_tokens": 0}` on a 100-token budget was
    admitted (the last field won, 0 counted) and the engine told 100000."""
    web, sim, _ = live
    key, api_key = make_key(budget=100)
    serve(web, key, "acc", sim.port)
    before = engine_requests(sim)
    status, _, raw = http(
        "POST",
        web.url + "/v1/chat/completions",
        key=key,
        body=chat_body("acc", max_tokens=100000, max_completion_tokens=0),
    )
    assert status == 429, raw
    error = json.loads(raw)["error"]
    assert error["code"] == "insufficient_quota" and "budget of 100 " in error["message"]
    reserved = int(re.search(r"may use (\d+) tokens", error["message"]).group(1))  # type: ignore[union-attr]
    assert reserved >= 100000
    assert engine_requests(sim) == before
    (row,) = wait_for_rows(api_key, 1)
    assert row.status == 429


def test_a_limited_key_binds_the_engine_to_what_was_reserved(
    live: tuple[Proc, Proc, Proc],
) -> None:
    """Without a max-token field the engine could generate up to its context length while a
    constant was reserved; now the body it gets carries the reserved cap."""
    web, sim, _ = live
    free_key, free_api_key = make_key("free")
    limited_key, limited_api_key = make_key("limited", budget=100_000)
    serve(web, free_key, "acc", sim.port)
    # First, before the gateway has learnt the model's context length from the engine: the
    # default output is reserved, and the engine is bound to it.
    limited = client(web, limited_key).chat.completions.create(
        model="acc", messages=[{"role": "user", "content": "go"}], n=2
    )
    assert limited.usage is not None and limited.usage.completion_tokens == DEFAULT_MAX * 2
    assert {c.finish_reason for c in limited.choices} == {"length"}
    free = client(web, free_key).chat.completions.create(
        model="acc", messages=[{"role": "user", "content": "go"}]
    )
    assert free.usage is not None and free.usage.completion_tokens == 16  # the sim's default
    # A cap larger than the client's own is never written: the client's smaller one stays.
    small = client(web, limited_key).chat.completions.create(
        model="acc", messages=[{"role": "user", "content": "go"}], max_completion_tokens=2
    )
    assert small.usage is not None and small.usage.completion_tokens == 2
    rows = wait_for_rows(limited_api_key, 2)
    assert sorted(r.completion_tokens for r in rows) == [2, DEFAULT_MAX * 2]
    wait_for_rows(free_api_key, 1)


# --------------------------------------------------------------------------- failure 2


def test_a_stream_the_upstream_ends_early_is_an_error_to_the_client_and_in_the_row(
    live: tuple[Proc, Proc, Proc],
) -> None:
    """Two chunks, then a clean end with no finish_reason and no [DONE]: the openai client
    used to report success with a truncated answer, and the row said 200 / stop."""
    web, sim, _ = live
    key, api_key = make_key()
    serve(web, key, "acc", sim.port)
    seen: list[str] = []
    with pytest.raises(openai.APIError) as failure:
        for chunk in client(web, key).chat.completions.create(
            model="acc",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=10,
            stream=True,
            extra_body={"sim": {"end_after_tokens": 2}},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                seen.append(chunk.choices[0].delta.content)
    assert "incomplete" in str(failure.value)
    assert seen == ["tok1", " tok2"]
    (row,) = wait_for_rows(api_key, 1)
    assert row.finish_reason == UsageRecord.FinishReason.UPSTREAM_ERROR
    assert row.completion_tokens == 2  # what was relayed


# --------------------------------------------------------------------------- failure 4


def test_counts_no_row_can_hold_are_clamped_and_recording_goes_on(
    live: tuple[Proc, Proc, Proc],
) -> None:
    """`"prompt_tokens": -5000` or `10**23` from an upstream used to stop the process's usage
    recording for good (every later row lost)."""
    web, sim, _ = live
    key, api_key = make_key()
    serve(web, key, "acc", sim.port)
    api = client(web, key)
    for reported in (-5000, 10**23):
        api.chat.completions.create(
            model="acc",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            extra_body={"sim": {"report_prompt_tokens": reported}},
        )
    for _ in range(5):
        api.chat.completions.create(
            model="acc", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    rows = wait_for_rows(api_key, 7)
    prompts = [r.prompt_tokens for r in rows]
    assert prompts[:2] == [0, 2**31 - 1]
    assert len(rows) == 7 and all(p == prompts[2] > 0 for p in prompts[2:])
    event = wait_until(
        lambda: Event.objects.filter(subject__startswith="upstream/").first(),
        what="an Event about the clamped counts",
    )
    assert "prompt_tokens=-5000" in event.message


def test_more_cached_tokens_than_prompt_tokens_are_held_to_the_prompt_and_told(
    live: tuple[Proc, Proc, Proc],
) -> None:
    """An engine whose usage says more of a prompt was cached than the prompt had: the row,
    the hit ratio the dashboard shows from it and routing's lesson take no more than the
    prompt, and operators are told which upstream said what."""
    web, sim, _ = live
    key, api_key = make_key()
    serve(web, key, "acc", sim.port)
    api = client(web, key)
    words = " ".join(f"word{n}" for n in range(200))  # many cache blocks, found the 2nd time
    for fault in ({}, {"sim": {"report_prompt_tokens": 3}}):
        api.chat.completions.create(
            model="acc",
            messages=[{"role": "user", "content": words}],
            max_tokens=1,
            extra_body=fault or None,
        )
    first, lying = wait_for_rows(api_key, 2)
    assert first.cached_tokens == 0 and first.prompt_tokens > 200
    assert (lying.prompt_tokens, lying.cached_tokens) == (3, 3)
    event = wait_until(
        lambda: Event.objects.filter(
            subject__startswith="upstream/", message__contains="cached_tokens="
        ).first(),
        what="an Event about the cached tokens held to the prompt",
    )
    assert re.search(r"cached_tokens=\d{3}\b.*to the prompt's", event.message), event.message


# --------------------------------------------------------------------------- failure 1


def stream_chunks(web: Proc, key: str, model: str, **extra: Any) -> list[Any]:
    return list(
        client(web, key).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=5,
            stream=True,
            **extra,
        )
    )


def test_an_engine_that_reports_no_usage_is_counted_by_its_tokenizer(
    live: tuple[Proc, Proc, Proc],
) -> None:
    """Streams from an engine that reports no usage were recorded with 0 tokens, refunded,
    and a client that asked for usage got no usage chunk."""
    web, sim, _ = live
    key, api_key = make_key(budget=100_000)
    serve(web, key, "acc", sim.port)
    # The sim's tokenizer: 4 per chat message plus one per word; each generated token a word.
    _, _, raw = http(
        "POST",
        sim.url + "/tokenize",
        body=json.dumps({"messages": [{"role": "user", "content": "one two three"}]}).encode(),
    )
    prompt = json.loads(raw)["count"]
    assert prompt == 7
    chunks = stream_chunks(
        web,
        key,
        "acc",
        stream_options={"include_usage": True},
        extra_body={"sim": {"no_usage": True}},
    )
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    assert (with_usage[0].usage.prompt_tokens, with_usage[0].usage.completion_tokens) == (prompt, 5)
    assert with_usage[0].usage.total_tokens == prompt + 5
    # Without include_usage: no usage chunk for the client, the same row.
    chunks = stream_chunks(web, key, "acc", extra_body={"sim": {"no_usage": True}})
    assert all(c.usage is None for c in chunks)
    # A whole answer without usage.
    client(web, key).chat.completions.create(
        model="acc",
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=3,
        extra_body={"sim": {"no_usage": True}},
    )
    rows = wait_for_rows(api_key, 3)
    assert [(r.prompt_tokens, r.completion_tokens, r.usage_source) for r in rows] == [
        (prompt, 5, "tokenized"),
        (prompt, 5, "tokenized"),
        (prompt, 3, "tokenized"),
    ]


def test_without_a_tokenizer_the_counts_are_estimated_and_marked_so(
    live: tuple[Proc, Proc, Proc],
) -> None:
    web, _, bare = live
    key, api_key = make_key()
    serve(web, key, "bare", bare.port)
    chunks = stream_chunks(
        web,
        key,
        "bare",
        stream_options={"include_usage": True},
        extra_body={"sim": {"no_usage": True}},
    )
    (usage_chunk,) = [c for c in chunks if c.usage is not None]
    # 4 for the message, "one two three" is 13 bytes: 4 more; one token per content event.
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (8, 5)
    (row,) = wait_for_rows(api_key, 1)
    assert (row.prompt_tokens, row.completion_tokens, row.usage_source) == (8, 5, "estimated")


def test_engine_counts_and_cached_prompt_tokens_are_recorded_as_the_engine_said(
    live: tuple[Proc, Proc, Proc],
) -> None:
    web, sim, _ = live
    key, api_key = make_key()
    serve(web, key, "acc", sim.port)
    chunks = stream_chunks(
        web,
        key,
        "acc",
        stream_options={"include_usage": True},
        extra_body={"sim": {"cached_tokens": 3}},
    )
    assert len([c for c in chunks if c.usage is not None]) == 1
    (row,) = wait_for_rows(api_key, 1)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (7, 5, 3)
    assert row.usage_source == "engine"


def test_a_client_that_hangs_up_is_billed_the_prompt_and_what_was_relayed(
    live: tuple[Proc, Proc, Proc],
) -> None:
    web, sim, _ = live
    key, api_key = make_key()
    serve(web, key, "acc", sim.port)
    stream = client(web, key).chat.completions.create(
        model="acc",
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=500,
        stream=True,
        extra_body={"sim": {"itl_ms": 20}},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    (row,) = wait_for_rows(api_key, 1)
    assert row.finish_reason == UsageRecord.FinishReason.CLIENT_DISCONNECT
    assert row.prompt_tokens == 7 and 3 <= row.completion_tokens < 500
    assert row.usage_source == "tokenized"


def test_without_a_max_token_field_the_context_the_engine_reports_is_reserved(
    live: tuple[Proc, Proc, Proc], tmp_path: Path
) -> None:
    """With no max-token field, the reservation is the model's context length (as its engine
    reports max_model_len) minus the prompt, and the engine is bound to it."""
    web, _, _ = live
    sim = start_sim(tmp_path / "ctx", ["ctx"], "--max-model-len", "60", "--output-tokens", "100")
    try:
        key, api_key = make_key(budget=100_000)
        serve(web, key, "ctx", sim.port)
        body = chat_body("ctx")
        # The first answer teaches the gateway the context length (until then: the default).
        status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=body)
        assert status == 200, raw
        cap = 60 - len(body) // 4

        def completion() -> int:
            status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=body)
            assert status == 200, raw
            return int(json.loads(raw)["usage"]["completion_tokens"])

        wait_until(lambda: completion() == cap, what="the context-sized cap")
        # A budget smaller than the context's room: refused, naming the budget.
        small_key, _ = make_key("small", budget=cap)
        status, _, raw = http("POST", web.url + "/v1/chat/completions", key=small_key, body=body)
        assert status == 429 and "budget" in json.loads(raw)["error"]["message"]
        wait_for_rows(api_key, 2)
    finally:
        sim.stop()


def test_the_catalogs_context_length_is_reserved_from_the_first_request(
    live: tuple[Proc, Proc, Proc], tmp_path: Path
) -> None:
    """A context length set in the catalog wins over what the engine reports, and needs no
    first answer to learn it: the first request without a max-token field is bound to it."""
    web, _, _ = live
    sim = start_sim(tmp_path / "cat", ["cat"], "--max-model-len", "60", "--output-tokens", "100")
    try:
        key, api_key = make_key(budget=100_000)
        serve_model("cat", [sim.port], context_length=40)
        wait_until(
            lambda: "cat" in [m.id for m in client(web, key).models.list().data],
            what="the web process routes cat",
        )
        body = chat_body("cat")
        status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 40 - len(body) // 4
        wait_for_rows(api_key, 1)
    finally:
        sim.stop()


def test_a_request_that_cannot_fit_the_context_is_refused_before_the_engine_sees_it(
    live: tuple[Proc, Proc, Proc], tmp_path: Path
) -> None:
    """Prompt plus the output asked for beyond the model's context: a 400 shaped as OpenAI's
    (``context_length_exceeded``), naming the context, and nothing reaches the engine; a
    request that fits still goes through."""
    web, _, _ = live
    sim = start_sim(tmp_path / "fit", ["fit"], "--max-model-len", "500")
    try:
        key, api_key = make_key()
        serve_model("fit", [sim.port], context_length=100)
        wait_until(
            lambda: "fit" in [m.id for m in client(web, key).models.list().data],
            what="the web process routes fit",
        )
        before = engine_requests(sim)
        with pytest.raises(openai.BadRequestError) as refused:
            client(web, key).chat.completions.create(
                model="fit", messages=[{"role": "user", "content": "one two three"}], max_tokens=100
            )
        assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
        assert "maximum context length is 100 tokens" in refused.value.message
        long_prompt = chat_body("fit", messages=[{"role": "user", "content": "word " * 400}])
        status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=long_prompt)
        assert status == 400, raw
        assert json.loads(raw)["error"]["code"] == "context_length_exceeded"
        assert engine_requests(sim) == before, "the engine saw a request that cannot fit"

        fits = chat_body("fit", max_tokens=50)
        status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=fits)
        assert status == 200, raw
        wait_until(lambda: engine_requests(sim) == before + 1, what="the fitting request ran")
        rows = wait_for_rows(api_key, 3)
        assert sorted(r.status for r in rows) == [200, 400, 400]
    finally:
        sim.stop()
