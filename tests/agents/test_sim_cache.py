"""The simulated engine's prefix cache and queue, as vLLM's: chained block hashes, a pool of
blocks with least-recently-used eviction, first-come-first-served admission, one prefill at a
time, batched decoding, and what usage and ``/metrics`` say about them. The block pool and the
scheduler are tested as plain data; the rest through HTTP, as a router sees an engine."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from agents.engines import launch
from agents.protocol.vocabulary import Engine
from agents.sim import SimConfig, SimServer, chat_tokens, count_chat_prompt_tokens
from agents.sim.cli import build_parser, config_from_args
from agents.sim.kvcache import BlockPool, chain_hashes
from agents.sim.scheduler import Scheduler, work_for
from tests.agents.conftest import SIM_MODEL, Starter
from tests.agents.test_agent_units import CTX, SHARD
from tests.agents.test_sim import metrics, sse_payloads
from tests.harness.waits import await_until

BLOCK = 16


def words(count: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def full_blocks(tokens: int) -> int:
    """What vLLM reports cached for a prompt of ``tokens`` all in the cache: every full block
    but the one holding the last token, which is always computed."""
    return (tokens - 1) // BLOCK * BLOCK


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def client_of(server: SimServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60)


async def chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], **extra: Any) -> Any:
    """A chat completion's JSON (a stream's usage chunk as its usage)."""
    body = {"model": SIM_MODEL, "messages": messages, "max_tokens": 4, **extra}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not extra.get("stream"):
        return response.json()
    chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return {"usage": chunks[-1]["usage"], "choices": [{"message": {"content": text}}]}


def cached(answer: Any) -> int:
    details = answer["usage"].get("prompt_tokens_details")
    return 0 if details is None else int(details["cached_tokens"])


STREAM = {"stream": True, "stream_options": {"include_usage": True}}


# --------------------------------------------------------------------------- blocks, as data


def test_each_full_block_hash_chains_over_every_block_before_it() -> None:
    tokens = [f"t{i}" for i in range(40)]  # two full blocks and a partial one
    hashes = chain_hashes(tokens, BLOCK)
    assert len(hashes) == 2  # only full blocks are hashed
    other_start = ["changed", *tokens[1:]]
    changed = chain_hashes(other_start, BLOCK)
    # Block 1's own tokens are the same, but not what came before it.
    assert changed[0] != hashes[0] and changed[1] != hashes[1]
    assert chain_hashes([*tokens[:32], "x", "y"], BLOCK) == hashes  # the partial one is not
    assert chain_hashes(tokens, BLOCK, hashes[0], start=1) == hashes[1:]  # a chain goes on
    assert chain_hashes(tokens[16:], BLOCK, hashes[0]) == hashes[1:]


def cache_sequence(pool: BlockPool, tokens: list[str]) -> list[int]:
    """A sequence computed and finished: its full blocks cached, given back tail first."""
    hashes = chain_hashes(tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache(block, block_hash)
    pool.release(reversed(blocks))
    return hashes


def test_eviction_takes_the_least_recently_used_free_block_a_prefix_tail_first() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)  # four usable: block 0 is the null block
    older = cache_sequence(pool, [f"a{i}" for i in range(8)])
    newer = cache_sequence(pool, [f"b{i}" for i in range(8)])
    assert (len(pool.hits(older)), len(pool.hits(newer)), pool.free) == (2, 2, 4)
    pool.release(pool.allocate(1))  # one block more: the older prefix's tail goes
    assert (len(pool.hits(older)), len(pool.hits(newer))) == (1, 2)
    # A hit makes a prefix recent: the next block taken is the newer prefix's tail.
    hit = pool.hits(newer[:1])
    pool.touch(hit)
    pool.release(hit)
    pool.touch(pool.hits(older))
    pool.release(pool.hits(older))
    pool.allocate(1)
    assert (len(pool.hits(older)), len(pool.hits(newer))) == (1, 1)


def test_a_block_a_running_request_holds_is_never_evicted() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    held = cache_sequence(pool, [f"a{i}" for i in range(8)])
    cache_sequence(pool, [f"b{i}" for i in range(8)])
    pool.touch(pool.hits(held))  # a running request hit them and holds them
    assert pool.free == 2 and pool.usage == 0.5
    pool.allocate(2)  # everything else is taken
    with pytest.raises(ValueError):
        pool.allocate(1)
    assert len(pool.hits(held)) == 2


def test_one_prefill_at_a_time_so_a_miss_delays_the_request_scheduled_after_it() -> None:
    now = [0.0]
    pool = BlockPool(num_blocks=1000, block_size=BLOCK)
    scheduler = Scheduler(pool, max_num_seqs=0, prefill_tokens_per_s=1000, clock=lambda: now[0])
    miss = work_for([[f"m{i}" for i in range(2000)]], None)
    small = work_for([[f"s{i}" for i in range(100)]], None)

    async def schedule_both() -> None:
        await scheduler.admit(miss)  # 2000 uncached tokens: two seconds of prefill
        now[0] = 0.5
        await scheduler.admit(small)

    asyncio.run(schedule_both())
    assert miss.ready_at == 2.0
    assert small.ready_at == pytest.approx(2.1)  # behind the miss, not at 0.5 + 0.1
    repeat = work_for([[f"m{i}" for i in range(2000)]], None)
    now[0] = 3.0
    asyncio.run(scheduler.admit(repeat))
    assert repeat.cached == full_blocks(2000)
    assert repeat.ready_at == pytest.approx(3.0 + (2000 - full_blocks(2000)) / 1000)


def test_the_newest_request_is_preempted_and_recomputes_what_is_no_longer_cached() -> None:
    now = [0.0]
    pool = BlockPool(num_blocks=5, block_size=4)  # four blocks of four tokens
    scheduler = Scheduler(pool, max_num_seqs=0, prefill_tokens_per_s=1000, clock=lambda: now[0])
    older = work_for([[f"a{i}" for i in range(6)]], None)
    newer = work_for([[f"b{i}" for i in range(6)]], None)

    async def schedule_both() -> None:
        await scheduler.admit(older)  # two blocks each: the cache is full
        await scheduler.admit(newer)

    asyncio.run(schedule_both())
    assert pool.free == 0
    # The older one's fourth token needs a third block: the newest request gives its two up.
    assert scheduler.grow(older, 4)
    assert (newer.preempted, list(scheduler.waiting), scheduler.preemptions) == (True, [newer], 1)
    assert not scheduler.grow(newer, 1)
    now[0] = 1.0
    scheduler.release(older)  # done: the preempted one is scheduled again
    assert newer in scheduler.running and not newer.preempted
    # Its first block (tokens 0-3) was still cached; it computes the other two tokens again.
    assert newer.ready_at == pytest.approx(1.0 + 2 / 1000)
    assert newer.cached == 0  # usage reports the first lookup, as vLLM's does


# --------------------------------------------------------------------------- what usage says


async def test_a_repeated_prompt_reports_its_full_blocks_cached_in_every_api(
    start_sim: Starter,
) -> None:
    server = await start_sim()
    prompt = user(words(60))  # 64 tokens: three full blocks before the last token's
    tokens = count_chat_prompt_tokens(prompt)
    async with client_of(server) as http:
        first = await chat(http, prompt)
        again = await chat(http, prompt)
        streamed = await chat(http, prompt, **STREAM)
        continuous = await http.post(
            "/v1/chat/completions",
            json={
                "model": SIM_MODEL,
                "messages": prompt,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
        completion = [
            (await http.post("/v1/completions", json={"prompt": words(60), "max_tokens": 1}))
            for _ in range(2)
        ]
    assert first["usage"]["prompt_tokens_details"] is None  # nothing cached: none, as vLLM
    assert cached(again) == cached(streamed) == full_blocks(tokens) == 48
    chunks = [json.loads(p) for p in sse_payloads(continuous.text)[:-1]]
    # Per-chunk usage never carries details (vLLM's continuous usage stats); the last does.
    assert all("prompt_tokens_details" not in c["usage"] for c in chunks[:-1])
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    # A completions prompt has no template around it: other tokens, its own blocks.
    assert [r.json()["usage"]["prompt_tokens_details"] for r in completion] == [
        None,
        {"cached_tokens": full_blocks(60)},
    ]
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        # The Responses API renders a string input as one user message: the chat's blocks.
        response = await c.responses.create(model=SIM_MODEL, input=words(60), max_output_tokens=1)
        stream = await c.chat.completions.create(
            model=SIM_MODEL,
            messages=[{"role": "user", "content": words(60)}],
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        last = [chunk async for chunk in stream][-1]
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == 48
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 48


@pytest.mark.parametrize("extra", [{}, STREAM], ids=["whole", "stream"])
async def test_a_shared_prefix_with_another_question_hits_the_shared_full_blocks_only(
    start_sim: Starter, extra: dict[str, Any]
) -> None:
    server = await start_sim()
    system = {"role": "system", "content": words(40, "s")}
    async with client_of(server) as http:
        first = await chat(http, [system, *user("what is one")], **extra)
        second = await chat(http, [system, *user("what is two")], **extra)
        other = await chat(http, [{"role": "system", "content": words(40, "o")}, *user("q")])
    # Shared: the system message's 40 words, its 4 markers and "what is", 46 tokens; of them
    # two full blocks.
    assert (cached(first), cached(second), cached(other)) == (0, 32, 0)


@pytest.mark.parametrize("extra", [{}, STREAM], ids=["whole", "stream"])
async def test_the_next_turn_of_a_chat_hits_through_the_previous_answer(
    start_sim: Starter, extra: dict[str, Any]
) -> None:
    server = await start_sim()
    history = [{"role": "system", "content": words(30, "s")}, *user(words(10, "u"))]
    first_prompt = count_chat_prompt_tokens(history)  # 48
    async with client_of(server) as http:
        first = await chat(http, history, max_tokens=20, **extra)
        answer = first["choices"][0]["message"]["content"]
        history += [{"role": "assistant", "content": answer}, *user("and then")]
        second = await chat(http, history, **extra)
    # The answer's blocks were cached as they filled: all of prompt and answer but the last
    # generated token (never computed) is known, 67 tokens, four full blocks.
    assert first_prompt == 48 and second["usage"]["prompt_tokens"] == 48 + 24 + 6
    assert cached(second) == 64 > first_prompt // BLOCK * BLOCK


async def test_tools_sit_in_the_system_turn_and_are_cached_with_it(start_sim: Starter) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    system = {"role": "system", "content": words(30, "s")}
    rendered = chat_tokens([system, *user("q")], tools)
    tool_words = json.dumps(tools).split()
    assert rendered[: 30 + len(tool_words)] == words(30, "s").split() + tool_words
    assert chat_tokens(user("q"), tools)[: len(tool_words)] == tool_words
    server = await start_sim()
    async with client_of(server) as http:
        await chat(http, [system, *user("first")], tools=tools)
        second = await chat(http, [system, *user("second")], tools=tools)
        counted = await http.post(
            "/tokenize", json={"messages": [system, *user("second")], "tools": tools}
        )
    shared = 30 + len(tool_words) + 4
    assert cached(second) == shared // BLOCK * BLOCK
    assert counted.json()["count"] == second["usage"]["prompt_tokens"]  # /tokenize agrees


# --------------------------------------------------------------------------- capacity


async def test_at_capacity_the_least_recently_used_prefix_goes_its_tail_first(
    start_sim: Starter,
) -> None:
    # Eight usable blocks; each prompt of 40 tokens takes three (two full and cached).
    server = await start_sim(num_gpu_blocks=9, max_model_len=128)
    prompts = {name: user(words(36, name)) for name in "abc"}
    async with client_of(server) as http:
        seen = [cached(await chat(http, prompts[n], max_tokens=1)) for n in "abc"]
        await chat(http, user("hi"), max_tokens=1)  # one block: a's tail, the oldest free
        seen += [cached(await chat(http, prompts[n], max_tokens=1)) for n in "ac"]
    assert seen == [0, 0, 0, 16, 32]  # a lost its tail and kept its head; c, the newest, all


async def test_a_running_request_keeps_its_blocks_however_many_others_come(
    start_sim: Starter,
) -> None:
    server = await start_sim(num_gpu_blocks=9, max_model_len=128)
    held = user(words(36, "held"))
    async with client_of(server) as http:
        running = asyncio.create_task(chat(http, held, max_tokens=1, sim={"ttft_ms": 2000}))

        async def holding() -> bool:
            return (await metrics(http))["vllm:num_requests_running"] == 1

        await await_until(holding, interval=0.01)
        # Three blocks held, 3/8 of the cache; the others go round the five left many times.
        assert (await metrics(http))["vllm:kv_cache_usage_perc"] == 3 / 8
        for i in range(6):
            assert cached(await chat(http, user(words(36, f"x{i}")), max_tokens=1)) == 0
        assert cached(await chat(http, held, max_tokens=1)) == 32
        assert (await running)["usage"]["completion_tokens"] == 1


async def test_a_request_the_cache_cannot_hold_yet_waits_visibly(start_sim: Starter) -> None:
    server = await start_sim(num_gpu_blocks=9, max_model_len=128)
    async with client_of(server) as http:
        slow = {"sim": {"ttft_ms": 1500}, "max_tokens": 1}
        first = asyncio.create_task(chat(http, user(words(76, "a")), **slow))  # five blocks
        await await_until(lambda: _gauges(http, running=1, waiting=0), interval=0.01)
        second = asyncio.create_task(chat(http, user(words(76, "b")), **slow))
        await await_until(lambda: _gauges(http, running=1, waiting=1), interval=0.01)
        answers = await asyncio.gather(first, second)
        assert [a["usage"]["completion_tokens"] for a in answers] == [1, 1]
        assert await _gauges(http, running=0, waiting=0)


async def _gauges(http: httpx.AsyncClient, *, running: int, waiting: int) -> bool:
    seen = await metrics(http)
    return (seen["vllm:num_requests_running"], seen["vllm:num_requests_waiting"]) == (
        running,
        waiting,
    )


async def test_when_decoding_outgrows_the_cache_the_newest_request_is_preempted_and_finishes(
    start_sim: Starter,
) -> None:
    # Four usable blocks: each request needs four by its end, two at its start.
    server = await start_sim(num_gpu_blocks=5, max_model_len=64, itl_ms=5)
    async with client_of(server) as http:
        answers = await asyncio.gather(
            chat(http, user(words(16, "a")), max_tokens=40, **STREAM),
            chat(http, user(words(16, "b")), max_tokens=40),
        )
        seen = await metrics(http)
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert texts == [" ".join(f"tok{i}" for i in range(1, 41))] * 2
    assert seen["vllm:num_preemptions_total"] >= 1
    assert seen["vllm:request_success_total"] == 2


# --------------------------------------------------------------------------- the queue


async def test_past_max_num_seqs_requests_wait_and_show_as_waiting(start_sim: Starter) -> None:
    server = await start_sim(max_num_seqs=2)
    async with client_of(server) as http:
        calls = [
            asyncio.create_task(chat(http, user("hi"), sim={"ttft_ms": 1000})) for _ in range(3)
        ]
        await await_until(lambda: _gauges(http, running=2, waiting=1), interval=0.01)
        answers = await asyncio.gather(*calls)
    assert [a["usage"]["completion_tokens"] for a in answers] == [4, 4, 4]


async def test_a_miss_in_prefill_holds_up_the_request_behind_it(start_sim: Starter) -> None:
    server = await start_sim(prefill_tokens_per_s=2000)
    order: list[str] = []
    async with client_of(server) as http:

        async def first_token(name: str, prompt: str) -> None:
            body = {"model": SIM_MODEL, "messages": user(prompt), "max_tokens": 1, **STREAM}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if '"content":"tok1"' in line:
                        order.append(name)

        long = asyncio.create_task(first_token("long miss", words(2000)))  # a second
        await await_until(lambda: _gauges(http, running=1, waiting=0), interval=0.01)
        await first_token("short", words(1000, "s"))  # half a second, behind it
        await long
    assert order == ["long miss", "short"]


async def test_the_decoding_step_grows_with_the_batch(start_sim: Starter) -> None:
    server = await start_sim(itl_ms=10, itl_ms_per_seq=100)
    # A first token 300 ms away, so that the three together all run before any decodes.
    wait = {"max_tokens": 3, "sim": {"ttft_ms": 300}}
    async with client_of(server) as http:
        started = time.monotonic()
        await chat(http, user("alone"), **wait)
        alone = time.monotonic() - started
        started = time.monotonic()
        await asyncio.gather(*(chat(http, user(f"q{i}"), **wait) for i in range(3)))
        together = time.monotonic() - started
    assert alone >= 0.32  # two steps of 10 ms after the first token
    # Two steps of 10 ms plus 100 ms for each other running request: two others, or at
    # the least one (had one come 300 ms late).
    assert together >= 0.5


# --------------------------------------------------------------------------- metrics


async def test_prefix_cache_counters_add_up_what_usage_reported(start_sim: Starter) -> None:
    server = await start_sim()
    system = {"role": "system", "content": words(50, "s")}
    prompts = prompt_tokens = hits = 0
    async with client_of(server) as http:
        for i, extra in enumerate([{}, STREAM, {}, STREAM]):
            answer = await chat(http, [system, *user(f"question {i}")], **extra)
            prompt_tokens += answer["usage"]["prompt_tokens"]
            hits += cached(answer)
            prompts += 1
        for _ in range(2):
            body = {"model": SIM_MODEL, "input": words(40), "max_output_tokens": 2}
            usage = (await http.post("/v1/responses", json=body)).json()["usage"]
            prompt_tokens += usage["input_tokens"]
            hits += usage["input_tokens_details"]["cached_tokens"]
        seen = await metrics(http)
    assert hits > 0
    assert seen["vllm:prefix_cache_queries_total"] == prompt_tokens
    assert seen["vllm:prefix_cache_hits_total"] == hits
    assert seen["vllm:prompt_tokens_total"] == prompt_tokens


async def test_metrics_carry_vllms_cache_names_types_and_config(start_sim: Starter) -> None:
    server = await start_sim(num_gpu_blocks=4097, block_size=32)
    async with client_of(server) as http:
        text = (await http.get("/metrics")).text
    for name, kind in (
        ("vllm:prefix_cache_queries_total", "counter"),
        ("vllm:prefix_cache_hits_total", "counter"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:num_requests_running", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:cache_config_info", "gauge"),
    ):
        assert f"# TYPE {name} {kind}\n" in text
    (info,) = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert 'block_size="32"' in info and 'num_gpu_blocks="4097"' in info
    assert 'enable_prefix_caching="True"' in info and info.endswith("} 1.0")


async def test_the_flag_and_the_fault_override_what_the_cache_says(start_sim: Starter) -> None:
    server = await start_sim(cached_tokens=5)
    async with client_of(server) as http:
        first = await chat(http, user(words(40)))
        faulted = await chat(http, user(words(40)), sim={"cached_tokens": 2})
        seen = await metrics(http)
    assert (cached(first), cached(faulted)) == (5, 2)
    assert seen["vllm:prefix_cache_hits_total"] == 7  # the counters say what usage said


async def test_without_prefix_caching_nothing_is_cached_or_counted(start_sim: Starter) -> None:
    server = await start_sim(enable_prefix_caching=False)
    async with client_of(server) as http:
        answers = [await chat(http, user(words(60))) for _ in range(2)]
        seen = await metrics(http)
    assert [cached(a) for a in answers] == [0, 0]
    assert seen["vllm:prefix_cache_queries_total"] == 0


# --------------------------------------------------------------------------- settings


def test_the_cache_flags_reach_the_simulator_from_a_profile() -> None:
    profile_args = (
        "--num-gpu-blocks-override", "400", "--block-size", "32", "--max-num-seqs", "8",
        "--prefill-tokens-per-s", "5000", "--itl-ms-per-seq", "2", "--max-model-len", "4096",
        "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
    )  # fmt: skip
    argv = launch(replace(SHARD, engine=Engine.SIM, args=profile_args), CTX, {}).argv
    args, ignored = build_parser().parse_known_args(argv[3:])
    config = config_from_args(args)
    assert ignored == []
    assert (config.num_gpu_blocks, config.block_size, config.seq_limit) == (400, 32, 8)
    assert (config.prefill_tokens_per_s, config.itl_ms_per_seq) == (5000, 2)
    assert config.enable_prefix_caching is False
    short = config_from_args(build_parser().parse_args(["--kv-blocks", "3000"]))
    assert (short.num_gpu_blocks, short.enable_prefix_caching, short.cached_tokens) == (
        3000,
        True,
        None,
    )
    assert config_from_args(build_parser().parse_args(["--max-concurrency", "3"])).seq_limit == 3


def test_a_cache_too_small_for_the_context_length_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"--num-gpu-blocks-override=10 holds 144 tokens"):
        SimConfig(num_gpu_blocks=10)
    assert SimConfig(num_gpu_blocks=10, max_model_len=144).kv_capacity_tokens == 144
