"""The simulated engine, driven the way llmgw and its users drive vLLM: the official openai
client for the API, raw HTTP for what a well-behaved client never sends, real processes for
the command line. No database: these tests need neither Django nor a store."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam

from agents.sim import (
    CRASH_EXIT_CODE,
    MESSAGE_OVERHEAD_TOKENS,
    SimConfig,
    SimServer,
    SimThread,
    count_chat_prompt_tokens,
    generated_text,
)
from tests.agents.conftest import SIM_MODEL, Starter
from tests.harness.procs import REPO_ROOT, Proc
from tests.harness.waits import await_until, wait_until

MODEL = SIM_MODEL
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "how are you today"}]
USER_TOKENS = 4 + MESSAGE_OVERHEAD_TOKENS  # four words and one message


@pytest_asyncio.fixture
async def sim(start_sim: Starter) -> SimServer:
    return await start_sim()


@pytest_asyncio.fixture
async def client(sim: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=sim.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest_asyncio.fixture
async def http(sim: SimServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim.port}", timeout=60) as c:
        yield c


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **extra}


def sse_payloads(text: str) -> list[str]:
    """The data lines of an SSE body, in order."""
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def metrics(http_client: httpx.AsyncClient) -> dict[str, float]:
    """Prometheus samples summed by metric name (labels folded)."""
    response = await http_client.get("/metrics")
    assert response.status_code == 200
    totals: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = re.match(r"([^{ ]+)(?:\{[^}]*\})? (\S+)", line).groups()  # type: ignore[union-attr]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


async def raw_exchange(port: int, data: bytes, timeout: float = 60.0) -> bytes:
    """Send bytes on a fresh connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


# --------------------------------------------------------------------------- shapes and usage


async def test_models_lists_every_served_name_in_vllms_shape(start_sim: Starter) -> None:
    server = await start_sim(served_model_names=("alias-a", "alias-b"), max_model_len=4096)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        page = await c.models.list()
    assert [m.id for m in page.data] == ["alias-a", "alias-b"]
    card = page.data[0].model_dump()
    assert card["object"] == "model"
    assert card["owned_by"] == "vllm"
    assert card["root"] == MODEL
    assert card["max_model_len"] == 4096


async def test_chat_completion_has_vllms_shape_and_exact_usage(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    completion = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert abs(completion.created - time.time()) < 60
    assert completion.system_fingerprint is None
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "tok1 tok2 tok3"
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == USER_TOKENS
    assert completion.usage.completion_tokens == 3
    assert completion.usage.total_tokens == USER_TOKENS + 3
    assert completion.usage.prompt_tokens_details is None
    raw = (await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))).json()
    assert raw["choices"][0]["stop_reason"] is None
    assert raw["usage"]["prompt_tokens_details"] is None
    assert raw["choices"][0]["message"]["tool_calls"] == []


async def test_chat_without_max_tokens_generates_the_default_length_and_stops(
    start_sim: Starter,
) -> None:
    server = await start_sim(output_tokens=5)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        completion = await c.chat.completions.create(model=MODEL, messages=USER)
    assert completion.choices[0].message.content == generated_text(5) == "tok1 tok2 tok3 tok4 tok5"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 5


async def test_prompt_tokens_count_every_text_part_of_every_message(
    client: openai.AsyncOpenAI,
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "one two three"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
                {"type": "text", "text": "four"},
            ],
        },
    ]
    completion = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 2 + 4 + 2 * MESSAGE_OVERHEAD_TOKENS
    assert count_chat_prompt_tokens(messages) == completion.usage.prompt_tokens


async def test_x_request_id_becomes_the_completion_id(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "abc-123"}
    )
    assert response.json()["id"] == "chatcmpl-abc-123"


async def test_cached_tokens_are_reported_in_prompt_tokens_details(
    client: openai.AsyncOpenAI,
) -> None:
    completion = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=1,
        extra_body={"sim": {"cached_tokens": 3}},
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 3


async def test_completions_give_one_choice_per_prompt_of_a_batch(
    client: openai.AsyncOpenAI,
) -> None:
    single = await client.completions.create(model=MODEL, prompt="a b c", max_tokens=2)
    assert single.id.startswith("cmpl-")
    assert single.object == "text_completion"
    assert single.choices[0].text == "tok1 tok2"
    assert single.usage is not None and single.usage.prompt_tokens == 3
    batch = await client.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=2)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == 5
    assert batch.usage.completion_tokens == 4


async def test_unknown_model_is_a_404_in_vllms_error_shape(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json={**chat_body(), "model": "nope"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }


async def test_max_model_len_rejects_long_requests_and_caps_default_output(
    start_sim: Starter,
) -> None:
    server = await start_sim(max_model_len=USER_TOKENS + 2, output_tokens=10)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http_client:
        refused = await http_client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        capped = await http_client.post("/v1/chat/completions", json=chat_body())
    assert refused.status_code == 400
    assert "maximum context length" in refused.json()["error"]["message"]
    assert capped.json()["usage"]["completion_tokens"] == 2
    assert capped.json()["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- streaming


async def test_stream_sends_a_role_chunk_then_one_delta_per_token_then_done(
    http: httpx.AsyncClient,
) -> None:
    response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=3, stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["transfer-encoding"] == "chunked"
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "tok1"},
        {"content": " tok2"},
        {"content": " tok3"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["object"] == "chat.completion.chunk"


async def test_stream_with_include_usage_ends_with_a_usage_chunk_before_done(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (USER_TOKENS, 4)
    assert last.usage.total_tokens == USER_TOKENS + 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == generated_text(4)
    raw = await http.post(
        "/v1/chat/completions",
        json=chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True}),
    )
    payloads = sse_payloads(raw.text)
    assert payloads[-1] == "[DONE]"
    assert all('"usage":null' in p for p in payloads[:-2])  # null on every chunk but the last
    assert json.loads(payloads[-2])["choices"] == []


async def test_continuous_usage_stats_put_a_running_usage_on_every_chunk(
    http: httpx.AsyncClient,
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    response = await http.post(
        "/v1/chat/completions", json=chat_body(max_tokens=3, stream=True, stream_options=options)
    )
    chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == USER_TOKENS for c in chunks)


async def test_completions_stream_text_completion_chunks(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model=MODEL, prompt="x y", max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == "tok1 tok2 tok3"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_responses_api_reports_usage_and_streams_its_named_events(
    client: openai.AsyncOpenAI,
) -> None:
    response = await client.responses.create(
        model=MODEL, input="one two three", instructions="be nice", max_output_tokens=2
    )
    assert response.id.startswith("resp_")
    assert response.output_text == "tok1 tok2"
    assert response.usage is not None
    assert response.usage.input_tokens == 3 + 2 + 2 * MESSAGE_OVERHEAD_TOKENS
    assert response.usage.output_tokens == 2
    assert response.status == "incomplete"  # max_output_tokens cut it short
    stream = await client.responses.create(model=MODEL, input="hi", stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 16
    assert kinds[-1] == "response.completed"
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseCompletedEvent)
    completed = last.response
    assert completed.status == "completed"
    assert completed.usage is not None
    assert completed.usage.output_tokens == 16
    assert completed.usage.input_tokens == 1 + MESSAGE_OVERHEAD_TOKENS
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_embeddings_are_deterministic_and_base64_decodes_to_the_same_floats(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    # The openai client asks for base64 and decodes it itself.
    result = await client.embeddings.create(model=MODEL, input=["red apple", "blue sky above"])
    assert [len(d.embedding) for d in result.data] == [16, 16]
    assert result.usage.prompt_tokens == 5
    floats = await http.post(
        "/v1/embeddings", json={"model": MODEL, "input": ["red apple"], "encoding_format": "float"}
    )
    body = floats.json()
    assert body["id"].startswith("embd-")
    assert body["data"][0]["embedding"] == result.data[0].embedding
    assert abs(sum(v * v for v in result.data[0].embedding) - 1.0) < 1e-5
    assert result.data[0].embedding != result.data[1].embedding
    packed = await http.post(
        "/v1/embeddings",
        json={"model": MODEL, "input": "red apple", "encoding_format": "base64", "dimensions": 4},
    )
    decoded = struct.unpack("<4f", base64.b64decode(packed.json()["data"][0]["embedding"]))
    assert len(decoded) == 4


async def test_rerank_ranks_the_relevant_document_first_on_all_three_paths(
    http: httpx.AsyncClient,
) -> None:
    body = {
        "model": MODEL,
        "query": "red apple",
        "documents": ["blue sky", "a red apple pie", {"text": "green pear"}],
        "top_n": 2,
    }
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        response = await http.post(path, json=body)
        assert response.status_code == 200
        result = response.json()
        assert result["results"][0]["index"] == 1
        assert len(result["results"]) == 2
        assert result["results"][0]["document"]["text"] == "a red apple pie"
        assert result["usage"]["total_tokens"] == (2 + 2) + (2 + 4) + (2 + 2)


# --------------------------------------------------------------------------- paced mode


async def test_paced_stream_keeps_time_to_first_token_and_the_gap_between_tokens(
    start_sim: Starter,
) -> None:
    server = await start_sim(ttft_ms=150, itl_ms=40)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        started = time.monotonic()
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=6,
            stream=True,
        )
        arrivals = [
            time.monotonic() - started
            async for chunk in stream
            if chunk.choices and chunk.choices[0].delta.content
        ]
    assert len(arrivals) == 6
    # Token i is sent at ttft + i * itl after the request arrives, so it can never be seen
    # earlier (how much later depends on the machine's load, so that is not asserted).
    schedule = [0.150 + 0.040 * i for i in range(6)]
    assert all(seen >= due for seen, due in zip(arrivals, schedule, strict=True))


async def test_per_request_timing_overrides_the_configured_instant_mode(
    http: httpx.AsyncClient,
) -> None:
    started = time.monotonic()
    response = await http.post(
        "/v1/chat/completions", json=chat_body(max_tokens=3, sim={"ttft_ms": 100, "itl_ms": 50})
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert elapsed >= 0.19  # ttft + 2 gaps, not instant


async def test_requests_past_max_concurrency_wait_and_show_as_waiting(
    start_sim: Starter,
) -> None:
    server = await start_sim(max_concurrency=1)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as c:
        # A second each, so that "one running, two waiting" lasts long enough to be seen.
        body = chat_body(max_tokens=1, sim={"ttft_ms": 1000})
        started = time.monotonic()
        calls = [asyncio.create_task(c.post("/v1/chat/completions", json=body)) for _ in range(3)]

        async def queued() -> bool:
            seen = await metrics(c)
            return seen["vllm:num_requests_running"] == 1 and seen["vllm:num_requests_waiting"] == 2

        await await_until(queued, interval=0.01)
        responses = await asyncio.gather(*calls)
        elapsed = time.monotonic() - started
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert elapsed >= 3.0  # three one-second generations, one at a time
        after = await metrics(c)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0


async def test_health_answers_503_until_the_startup_delay_has_passed(start_sim: Starter) -> None:
    # Long enough that the first requests below surely come before it is over.
    server = await start_sim(startup_delay=3)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        early = await c.get("/health")
        refused = await c.post("/v1/chat/completions", json=chat_body())
        assert early.status_code == 503
        assert refused.status_code == 503

        async def healthy() -> bool:
            return (await c.get("/health")).status_code == 200

        await await_until(healthy, interval=0.01)
        ready = await c.get("/health")
        served = await c.post("/v1/chat/completions", json=chat_body())
    assert ready.content == b""
    assert served.status_code == 200


# --------------------------------------------------------------------------- faults


async def test_injected_failure_answers_its_status_with_retry_after(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    response = await http.post(
        "/v1/chat/completions", json=chat_body(sim={"fail": 503, "retry_after": 2})
    )
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == 503
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            extra_body={"sim": {"fail": 500}},
        )
    assert caught.value.status_code == 500
    assert (await metrics(http))["sim:request_failed_total"] == 2


async def test_fail_rate_fails_every_request_when_set_to_one(start_sim: Starter) -> None:
    server = await start_sim(fail_rate=1.0, fail_status=502)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        statuses = [(await c.post("/v1/chat/completions", json=chat_body())).status_code]
        statuses.append((await c.post("/v1/completions", json={"prompt": "x"})).status_code)
    assert statuses == [502, 502]


async def test_hang_before_first_byte_sends_nothing_until_the_client_gives_up(
    sim: SimServer, http: httpx.AsyncClient
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await http.post(
            "/v1/chat/completions",
            json=chat_body(stream=True, sim={"hang": "before_first_byte"}),
            timeout=0.3,
        )

    async def given_up() -> bool:
        return sim.stats.cancelled == 1 and sim.running == 0

    await await_until(given_up, interval=0.01)


async def test_hang_rate_hangs_requests_from_the_command_line(start_sim: Starter) -> None:
    server = await start_sim(hang_rate=1.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=chat_body(), timeout=0.2)


async def test_hang_mid_stream_stops_after_the_first_token(http: httpx.AsyncClient) -> None:
    body = chat_body(stream=True, sim={"hang": "mid_stream"})

    async def next_event(lines: AsyncIterator[str], timeout: float) -> str:
        while not (line := await asyncio.wait_for(anext(lines), timeout)).startswith("data: "):
            pass
        return line

    async with http.stream("POST", "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.aiter_lines()
        received = [await next_event(lines, 60), await next_event(lines, 60)]
        with pytest.raises(TimeoutError):  # then nothing: the engine hangs
            await next_event(lines, 0.5)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in received]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "tok1"}]


async def test_fail_after_tokens_cuts_the_stream_without_a_terminating_chunk(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=10,
        stream=True,
        extra_body={"sim": {"fail_after_tokens": 3}},
    )
    contents: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            contents.append(chunk.choices[0].delta.content or "")
    assert "".join(contents) == "tok1 tok2 tok3"
    seen = await metrics(http)
    assert seen["sim:request_failed_total"] == 1
    assert seen["vllm:request_success_total"] == 0


async def test_faults_endpoint_fails_the_next_requests_that_cannot_change_their_body(
    http: httpx.AsyncClient,
) -> None:
    armed = await http.post("/sim/faults", json={"fail": 429, "retry_after": 1, "times": 2})
    assert armed.json() == {"faults": {"fail": 429, "retry_after": 1.0}, "times": 2}
    statuses = [(await http.post("/v1/chat/completions", json=chat_body())).status_code]
    statuses.append((await http.post("/v1/chat/completions", json=chat_body())).status_code)
    statuses.append((await http.post("/v1/chat/completions", json=chat_body())).status_code)
    assert statuses == [429, 429, 200]
    await http.post("/sim/faults", json={"fail": 500})
    assert (await http.post("/v1/chat/completions", json=chat_body())).status_code == 500
    assert (await http.delete("/sim/faults")).json() == {"faults": {}, "times": None}
    assert (await http.post("/v1/chat/completions", json=chat_body())).status_code == 200


async def test_crash_in_process_drops_every_connection_and_stops_listening(
    sim: SimServer, http: httpx.AsyncClient
) -> None:
    with pytest.raises(httpx.TransportError):
        await http.post("/v1/chat/completions", json=chat_body(sim={"crash": True}))
    assert sim.crashed.is_set()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as fresh:
            await fresh.get(f"http://127.0.0.1:{sim.port}/health")


async def test_client_disconnect_cancels_the_generation_and_leaks_no_task(
    start_sim: Starter,
) -> None:
    server = await start_sim(itl_ms=50)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as c:
        body = chat_body(max_tokens=200, stream=True)
        async with c.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if "tok2" in line:
                    break  # leaving the block closes the connection mid-stream

        async def cancelled() -> bool:
            seen = await metrics(c)
            return (
                seen["sim:request_cancelled_total"] == 1 and seen["vllm:num_requests_running"] == 0
            )

        await await_until(cancelled, interval=0.01)
        assert (await metrics(c))["vllm:request_success_total"] == 0
    generating = [t for t in asyncio.all_tasks() if "_generate" in repr(t.get_coro())]
    assert generating == []


# --------------------------------------------------------------------------- metrics


async def test_metrics_counters_equal_the_usage_every_response_reported(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    prompt = completion = 0
    chat = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert chat.usage is not None
    prompt, completion = (
        prompt + chat.usage.prompt_tokens,
        completion + chat.usage.completion_tokens,
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage async for c in stream][-1]
    assert usage is not None
    prompt, completion = prompt + usage.prompt_tokens, completion + usage.completion_tokens
    batch = await client.completions.create(model=MODEL, prompt=["a b", "c"], max_tokens=3)
    assert batch.usage is not None
    prompt, completion = (
        prompt + batch.usage.prompt_tokens,
        completion + batch.usage.completion_tokens,
    )
    embedded = await client.embeddings.create(model=MODEL, input="a b c d")
    prompt += embedded.usage.prompt_tokens
    answer = await client.responses.create(model=MODEL, input="hello", max_output_tokens=5)
    assert answer.usage is not None
    prompt, completion = prompt + answer.usage.input_tokens, completion + answer.usage.output_tokens
    await http.post("/v1/chat/completions", json=chat_body(sim={"fail": 500}))  # not counted
    seen = await metrics(http)
    assert seen["vllm:prompt_tokens_total"] == prompt
    assert seen["vllm:generation_tokens_total"] == completion
    assert seen["vllm:request_success_total"] == 5
    assert completion == 2 + 2 * 16 + 2 * 3 + 5


async def test_metrics_use_vllms_names_and_model_name_labels(start_sim: Starter) -> None:
    server = await start_sim(served_model_names=("public-name",))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        text = (await c.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert f'{name}{{model_name="public-name"}} ' in text
    assert 'vllm:request_success_total{finished_reason="stop",model_name="public-name"}' in text


# --------------------------------------------------------------------------- HTTP edges


async def test_malformed_json_is_a_400(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


async def test_unknown_path_is_a_404_and_wrong_method_a_405(http: httpx.AsyncClient) -> None:
    missing = await http.get("/v1/nothing")
    assert missing.status_code == 404
    assert missing.json() == {"detail": "Not Found"}
    wrong = await http.get("/v1/chat/completions")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"


async def test_a_body_over_16_mib_is_refused_with_413(http: httpx.AsyncClient) -> None:
    assert SimConfig().max_body_bytes == 16 * 1024 * 1024
    response = await http.post("/v1/chat/completions", content=b"x" * (16 * 1024 * 1024 + 1))
    assert response.status_code == 413
    assert response.headers["connection"] == "close"


async def test_oversized_headers_and_garbage_request_lines_are_refused(sim: SimServer) -> None:
    huge = b"GET /health HTTP/1.1\r\nx-big: " + b"a" * (70 * 1024) + b"\r\n\r\n"
    assert (await raw_exchange(sim.port, huge)).startswith(b"HTTP/1.1 431 ")
    garbage = await raw_exchange(sim.port, b"HELLO\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 ")


async def test_keep_alive_answers_pipelined_requests_in_order(sim: SimServer) -> None:
    body = json.dumps(chat_body(max_tokens=1)).encode()
    post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
    data = post % (len(body), body) + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    data += b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    answer = await raw_exchange(sim.port, data)
    assert re.findall(rb"HTTP/1.1 (\d+)", answer) == [b"200", b"200", b"200"]
    assert answer.index(b"chat.completion") < answer.index(b'"object":"list"')


async def test_accepted_sockets_have_nagle_turned_off(sim: SimServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    # Nagle's algorithm would hold each small SSE chunk back for the client's delayed ACK;
    # timing that from outside is flaky, so look at the server's end of the socket itself.
    (conn,) = sim._conns
    assert conn.transport is not None
    server_socket = conn.transport.get_extra_info("socket")
    assert server_socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    writer.close()


async def test_chunked_request_bodies_are_read(http: httpx.AsyncClient) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        body = json.dumps(chat_body(max_tokens=2)).encode()
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    response = await http.post("/v1/chat/completions", content=pieces())
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert response.json()["choices"][0]["message"]["content"] == "tok1 tok2"


# --------------------------------------------------------------------------- in-process APIs


def test_sim_thread_serves_synchronous_clients() -> None:
    with SimThread(SimConfig(model=MODEL)) as thread:
        client = openai.OpenAI(base_url=thread.base_url, api_key="x", max_retries=0)
        completion = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        client.close()
    assert completion.choices[0].message.content == "tok1 tok2"


# --------------------------------------------------------------------------- the process


def sim_process(log_dir: Path, *args: str) -> Proc:
    """``python -m agents.sim --port 0``: it binds a port of its own and says which."""
    argv = [sys.executable, "-m", "agents.sim", "--port", "0", *args]
    proc = Proc("sim", argv, log_dir, {**os.environ, "PYTHONUNBUFFERED": "1"}).start()
    said = wait_until(
        lambda: re.search(r"sim listening on 127\.0\.0\.1:(\d+)", proc.log()),
        what="the simulator to say where it listens",
        logs=[proc],
    )
    proc.port = int(said.group(1))
    return proc


@pytest.mark.e2e
async def test_process_serves_the_openai_client_and_exits_0_on_sigterm_after_finishing(
    tmp_path: Path,
) -> None:
    sim = sim_process(tmp_path, "--model", MODEL, "--tensor-parallel-size", "1")
    try:
        base = sim.url
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as c:
            completion = await c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
            assert completion.choices[0].message.content == "tok1 tok2"
        async with httpx.AsyncClient(base_url=base, timeout=60) as http_client:
            # Long enough to be seen running, and still running when the signal comes.
            body = chat_body(max_tokens=1, sim={"ttft_ms": 3000})
            in_flight = asyncio.create_task(http_client.post("/v1/chat/completions", json=body))

            async def running() -> bool:
                return (await metrics(http_client))["vllm:num_requests_running"] == 1

            await await_until(running, interval=0.01)
            sim.signal(signal.SIGTERM)
            finished = await in_flight
        assert finished.status_code == 200
        assert await asyncio.to_thread(sim.wait) == 0
    finally:
        sim.kill()


@pytest.mark.e2e
async def test_process_crashes_with_a_non_zero_exit_after_n_requests(tmp_path: Path) -> None:
    sim = sim_process(tmp_path, "--model", MODEL, "--crash-after", "2")
    try:
        async with httpx.AsyncClient(base_url=sim.url, timeout=60) as c:
            ok = [(await c.post("/v1/chat/completions", json=chat_body())).status_code]
            ok.append((await c.post("/v1/completions", json={"prompt": "x"})).status_code)
            assert ok == [200, 200]
            with pytest.raises(httpx.TransportError):
                await c.post("/v1/chat/completions", json=chat_body())
        assert await asyncio.to_thread(sim.wait) == CRASH_EXIT_CODE
    finally:
        sim.kill()


@pytest.mark.e2e
def test_process_exits_non_zero_on_a_crash_asked_for_in_the_body(tmp_path: Path) -> None:
    sim = sim_process(tmp_path, "--model", MODEL)
    try:
        with pytest.raises(httpx.TransportError):
            httpx.post(
                f"{sim.url}/v1/chat/completions", json=chat_body(sim={"crash": True}), timeout=60
            )
        assert sim.wait() == CRASH_EXIT_CODE
    finally:
        sim.kill()


def test_settings_that_would_make_the_simulator_lie_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"--output-tokens=0.*--fail-rate=1\.5"):
        SimConfig(output_tokens=0, fail_rate=1.5)


def test_the_simulator_imports_without_django() -> None:
    code = "import sys, agents.sim; sys.exit('django' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=False).returncode == 0


def test_sim_thread_start_raises_when_the_port_is_taken() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        taken = probe.getsockname()[1]
        probe.listen()
        with pytest.raises(OSError):
            SimThread(SimConfig(port=taken)).start()


async def test_with_an_api_key_v1_answers_401_without_it_and_health_stays_open(
    start_sim: Starter,
) -> None:
    """As vLLM's --api-key: the engine serves only callers holding its key (the gateway)."""
    sim = await start_sim(api_key="k-123")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim.port}", timeout=60) as http:
        body = {"model": MODEL, "messages": USER, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-123"}):
            refused = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert refused.status_code == 401
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.post("/sim/faults", json={})).status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
    async with openai.AsyncOpenAI(base_url=sim.base_url, api_key="k-123", max_retries=0) as c:
        answer = await c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert answer.usage is not None and answer.usage.completion_tokens == 2


def test_the_command_line_takes_the_key_from_the_environment_as_vllm_does() -> None:
    from agents.sim.cli import build_parser, config_from_args

    env = dict(os.environ, VLLM_API_KEY="from-env")
    old = os.environ.copy()
    os.environ.update(env)
    try:
        config = config_from_args(build_parser().parse_args([]))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert config.api_key == "from-env"
