"""Counting with a real engine that reports no usage in streams: llama.cpp's server
(llama-cpp-python, the ``llamacpp`` recipe) on the tiny GGUF model the agent tests write,
behind a live web process, with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from control.models import Replica
from tests.agents.agent_e2e import write_tiny_llama
from tests.harness.factories import make_key, serve_model
from tests.harness.live import http, start_web, stop_checked, wait_for_rows
from tests.harness.procs import PYTHON, Proc, free_port
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.llamacpp, pytest.mark.django_db(transaction=True)]


# The engine's own key, as the agent starts it (API_KEY): only the gateway holds it.
ENGINE_KEY = "engine-key-of-the-tiny-replica"


@pytest.fixture
def llamacpp(tmp_path: Path) -> Iterator[Proc]:
    model = tmp_path / "tiny-llama.gguf"
    write_tiny_llama(model)
    port = free_port()
    argv = [
        PYTHON, "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--model_alias", "tiny", "--n_ctx", "256",
    ]  # fmt: skip
    env = {**os.environ, "API_KEY": ENGINE_KEY}
    engine = Proc(f"llamacpp-{port}", argv, tmp_path, env, port=port).start()
    try:
        wait_until(lambda: engine_call(engine, "GET", "/v1/models")[0] == 200, logs=[engine])
        yield engine
    finally:
        engine.stop()


def engine_call(engine: Proc, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    try:
        status, _, raw = http(method, engine.url + path, key=ENGINE_KEY, body=data)
    except OSError:
        return 0, None
    return status, json.loads(raw) if status == 200 else raw


def serve_tiny(port: int) -> None:
    served = serve_model("tiny", [port])
    Replica.objects.filter(pk=served.replicas[0].pk).update(engine_key=ENGINE_KEY)


def tokenize(engine: Proc, text: str) -> int:
    """llama.cpp's own count of plain text (llama-cpp-python's endpoint), BOS included."""
    status, answer = engine_call(engine, "POST", "/extras/tokenize/count", {"input": text})
    assert status == 200, answer
    return int(answer["count"])


def chat_prompt_tokens(engine: Proc, messages: list[dict[str, str]]) -> int:
    """What the engine itself counts for a chat prompt (its chat template included)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
    status, answer = engine_call(engine, "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    return int(answer["usage"]["prompt_tokens"])


def test_a_stream_from_llamacpp_gets_one_usage_chunk_counted_by_its_tokenizer(
    tmp_path: Path, llamacpp: Proc
) -> None:
    web = start_web(tmp_path / "var")
    try:
        key, api_key = make_key()
        serve_tiny(llamacpp.port)
        api = openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=120)
        wait_until(lambda: "tiny" in [m.id for m in api.models.list().data])
        chunks = list(
            api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hello there"}],
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # The prompt as the engine counts it, chat template included (its tokenize endpoint
        # sees only text: far fewer tokens). A completion carries no BOS: the endpoint's count
        # of "" (BOS alone) is taken off.
        prompt = chat_prompt_tokens(llamacpp, [{"role": "user", "content": "hello there"}])
        assert prompt > tokenize(llamacpp, "hello there")
        completion = tokenize(llamacpp, text) - tokenize(llamacpp, "")
        usage = with_usage[0].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
            prompt,
            completion,
        )
        assert completion > 0
        (row,) = wait_for_rows(api_key, 1)
        assert (row.prompt_tokens, row.completion_tokens, row.usage_source) == (
            prompt,
            completion,
            "tokenized",
        )
    finally:
        stop_checked(web)


@contextlib.contextmanager
def without_tokenizer(engine: Proc) -> Iterator[int]:
    """A pass-through in front of the engine that answers 404 to its tokenize endpoints, as an
    engine without one would; the port it listens on."""

    async def forward(request: web.Request) -> web.StreamResponse:
        if "tokenize" in request.path:
            return web.Response(status=404)
        headers = {
            "Content-Type": request.headers.get("Content-Type", "application/json"),
            "Authorization": request.headers.get("Authorization", ""),
        }
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method,
                engine.url + request.path_qs,
                data=await request.read(),
                headers=headers,
            ) as upstream,
        ):
            answer = web.StreamResponse(
                status=upstream.status,
                headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
            )
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", forward)
    runner = web.AppRunner(app)
    port = free_port()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_without_its_tokenizer_a_stream_from_llamacpp_is_estimated(
    tmp_path: Path, llamacpp: Proc
) -> None:
    web_proc = start_web(tmp_path / "var")
    try:
        with without_tokenizer(llamacpp) as port:
            key, api_key = make_key()
            serve_tiny(port)
            api = openai.OpenAI(
                base_url=web_proc.url + "/v1", api_key=key, max_retries=0, timeout=120
            )
            wait_until(lambda: "tiny" in [m.id for m in api.models.list().data])
            chunks = list(
                api.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hello there"}],
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            with_usage = [c for c in chunks if c.usage is not None]
            assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
            # gateway.relay.counting's estimate: 4 per message plus one per 4 bytes of its text, and
            # one token per content event relayed.
            prompt = 4 + -(-len(b"hello there") // 4)
            completion = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
            usage = with_usage[0].usage
            assert usage is not None
            assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, completion)
            assert completion > 0
            (row,) = wait_for_rows(api_key, 1)
            assert (row.prompt_tokens, row.completion_tokens, row.usage_source) == (
                prompt,
                completion,
                "estimated",
            )
    finally:
        stop_checked(web_proc)
