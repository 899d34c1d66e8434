"""The four workloads and the streaming client that sends them.

Every request is a streamed chat completion with ``stream_options.include_usage``, read
as a client reads it: the time to first token is taken at the first event with content, the
token counts (``cached_tokens`` included) from the final usage chunk. Text is made of seeded
pseudo-words (the sim counts a word as a token), so every target gets the very same requests.

- ``shared``: eight system prompts of 1,500 tokens, each request one of them (a seeded draw)
  and a question of its own; closed loop, 64 clients, so the engines are busy and a miss's
  prefill holds up the requests behind it.
- ``multi-turn``: 100 sessions of 6 turns; each turn resends the whole history, previous
  answers included. Each session opens with a document of its own (500 tokens) after a
  one-line system prompt (what sessions share is the ``shared`` workload's subject, not this
  one's); 24 sessions run at a time (as one ends the next begins), so their histories fit the
  fleet's caches only if each session stays on one replica.
- ``no-sharing``: prompts of 800 tokens that share nothing, open loop (Poisson arrivals) at 60%
  of what four replicas prefill.
- ``hot-prefix``: one 1,500-token prefix for every request, open loop at twice what one replica
  decodes at its full batch: a router that keeps the prefix on one replica queues there.

Three more, run when named (``--workload``), no goal of BENCHMARK.md on them: shapes a router
by the cache can get wrong where the four above do not look.

- ``preamble``: one short preamble (250 tokens) before a document of each request's own (1,500
  tokens), open loop at 60% of what the replicas prefill: a router that follows the preamble
  piles every request onto one replica;
- ``short-chat``: 200 chats of six short turns (20-word questions, 30-token answers) under one
  60-token system prompt, 48 at a time: prompts of a few hundred bytes;
- ``mixed``: four system prompts of 3,000 tokens and sixteen of 400, each request one of them
  and a question, closed loop of 48 clients: homes of very different weights.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.routing.sims import MAX_NUM_SEQS, MODEL, PREFILL_TOKENS_PER_S, REPLICAS, step_ms

Message = dict[str, str]
REQUEST_TIMEOUT_S = 300.0  # one request, sent to its last byte: a hot replica's queue may be long


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    ttft: float = 0.0  # seconds to the first content token
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    answer: str = ""
    error: str = ""


@dataclass
class Client:
    """Sends one chat completion to a router and reads its stream."""

    session: aiohttp.ClientSession
    url: str  # the router's base, without /v1
    key: str

    async def chat(self, messages: list[Message], max_tokens: int) -> Outcome:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": messages,
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        started = time.perf_counter()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async with self.session.post(
                    self.url + "/v1/chat/completions", data=body, headers=headers
                ) as response:
                    if response.status != 200:
                        text = (await response.read())[:200].decode(errors="replace")
                        return Outcome(False, error=f"HTTP {response.status}: {text}")
                    return await read_stream(response.content, started)
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            return Outcome(False, error=f"{type(err).__name__}: {err}")


async def read_stream(content: aiohttp.StreamReader, started: float) -> Outcome:
    out = Outcome(False)
    parts: list[str] = []
    first = 0.0
    usage: dict[str, Any] | None = None
    async for line in content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                first = first or time.perf_counter() - started
                parts.append(text)
    if usage is None or not first:
        out.error = "stream ended without usage" if first else "stream without content"
        return out
    details = usage.get("prompt_tokens_details") or {}
    out.ok = True
    out.ttft = first
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.cached_tokens = int(details.get("cached_tokens") or 0)
    out.completion_tokens = int(usage.get("completion_tokens") or 0)
    out.answer = "".join(parts)
    return out


# --- the requests ---------------------------------------------------------------------------------

SYLLABLES = (
    "ka ri to mo na el sa vi lu den par ost ing ver ta qua lo mi zen bar cor ith un ex al pre "
    "tor ful ness ment ade ic ous ar er on ly"
)


class Words:
    """Seeded text: the same seed, the same words, on every target."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        vocabulary, syllables = random.Random(0), SYLLABLES.split()
        self.vocabulary = [
            "".join(vocabulary.choice(syllables) for _ in range(vocabulary.randint(1, 3)))
            for _ in range(4000)
        ]

    def text(self, count: int) -> str:
        return " ".join(self.rng.choice(self.vocabulary) for _ in range(count))

    def question(self, count: int = 30) -> str:
        return self.text(count).capitalize() + "?"


@dataclass(frozen=True)
class Size:
    """How much of each workload a run sends (full, or ``--quick``)."""

    shared_requests: int
    sessions: int
    sessions_at_once: int
    no_sharing_requests: int
    hot_requests: int


FULL = Size(
    shared_requests=400,
    sessions=100,
    sessions_at_once=24,
    no_sharing_requests=240,
    hot_requests=400,
)
# Quick: the same pressure on the caches (sessions at once, rates), for less time.
QUICK = Size(
    shared_requests=96,
    sessions=24,
    sessions_at_once=24,
    no_sharing_requests=60,
    hot_requests=120,
)

SHARED_PROMPTS = 8
SHARED_PROMPT_TOKENS = 1_500
SHARED_CLIENTS = 64
SHARED_ANSWER_TOKENS = 48
TURNS = 6
APP_PROMPT = "You are the help desk of the product. Answer briefly."
SESSION_DOCUMENT_TOKENS = 500  # what each session opens with
TURN_ANSWER_TOKENS = 64
NO_SHARING_PROMPT_TOKENS = 800
NO_SHARING_ANSWER_TOKENS = 48
# 60% of what four replicas prefill when nothing is cached.
NO_SHARING_RATE = 0.6 * REPLICAS * PREFILL_TOKENS_PER_S / NO_SHARING_PROMPT_TOKENS
HOT_PROMPT_TOKENS = 1_500
HOT_ANSWER_TOKENS = 48
# Twice what one replica finishes at its full batch (cached prefix: decode bound).
HOT_RATE = 2 * MAX_NUM_SEQS / (HOT_ANSWER_TOKENS * step_ms(MAX_NUM_SEQS) / 1000)
PREAMBLE_TOKENS = 250
PREAMBLE_DOCUMENT_TOKENS = 1_500
# 60% of what four replicas prefill, as for no sharing.
PREAMBLE_RATE = 0.6 * REPLICAS * PREFILL_TOKENS_PER_S / (PREAMBLE_TOKENS + PREAMBLE_DOCUMENT_TOKENS)
SHORT_SYSTEM_TOKENS = 60
SHORT_ANSWER_TOKENS = 30
SHORT_CHATS_AT_ONCE = 48
MIXED_ANSWER_TOKENS = 32
MIXED_CLIENTS = 48

Send = Callable[[list[Message], int], Awaitable[Outcome]]


def now() -> float:
    """The running loop's clock: what a workload paces and times itself by (on a loop of
    virtual time, ``bench/routing/model.py``'s, it is that time)."""
    return asyncio.get_running_loop().time()


@dataclass
class Run:
    """What one workload did: every outcome and its wall time."""

    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0


async def closed_loop(send: Send, calls: list[tuple[list[Message], int]], clients: int) -> Run:
    """``clients`` clients, each sending its next call as soon as its last one is answered."""
    run = Run()
    queue = iter(calls)

    async def client() -> None:
        for messages, max_tokens in queue:
            run.outcomes.append(await send(messages, max_tokens))

    started = now()
    await asyncio.gather(*(client() for _ in range(clients)))
    run.seconds = now() - started
    return run


async def open_loop(
    send: Send, calls: list[tuple[list[Message], int]], rate: float, seed: int
) -> Run:
    """Calls at Poisson arrivals of ``rate`` a second, whatever the answers take."""
    run = Run()
    rng = random.Random(seed)

    async def one(messages: list[Message], max_tokens: int) -> None:
        run.outcomes.append(await send(messages, max_tokens))

    started = now()
    due = started
    tasks = []
    for messages, max_tokens in calls:
        due += rng.expovariate(rate)
        delay = due - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(messages, max_tokens)))
    await asyncio.gather(*tasks)
    run.seconds = now() - started
    return run


async def shared(send: Send, size: Size) -> Run:
    words = Words(seed=1)
    prompts = [
        f"You are assistant {n} of the catalog. " + words.text(SHARED_PROMPT_TOKENS)
        for n in range(SHARED_PROMPTS)
    ]
    calls = []
    for _ in range(size.shared_requests):
        system = prompts[words.rng.randrange(SHARED_PROMPTS)]
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": words.question()},
        ]
        calls.append((messages, SHARED_ANSWER_TOKENS))
    return await closed_loop(send, calls, SHARED_CLIENTS)


async def multi_turn(send: Send, size: Size) -> Run:
    words = Words(seed=2)
    sessions = []
    for n in range(size.sessions):
        opening = f"Session {n}. Read this first: " + words.text(SESSION_DOCUMENT_TOKENS)
        questions = [words.question() for _ in range(TURNS)]
        sessions.append((opening, questions))
    run = Run()
    gate = asyncio.Semaphore(size.sessions_at_once)

    async def session(opening: str, questions: list[str]) -> None:
        async with gate:
            history: list[Message] = [{"role": "system", "content": APP_PROMPT}]
            for turn, question in enumerate(questions):
                content = f"{opening}\n\n{question}" if turn == 0 else question
                history.append({"role": "user", "content": content})
                outcome = await send(list(history), TURN_ANSWER_TOKENS)
                run.outcomes.append(outcome)
                if not outcome.ok:
                    return  # a session whose turn failed ends there, as a user would leave
                history.append({"role": "assistant", "content": outcome.answer})

    started = now()
    await asyncio.gather(*(session(opening, questions) for opening, questions in sessions))
    run.seconds = now() - started
    return run


async def no_sharing(send: Send, size: Size) -> Run:
    words = Words(seed=3)
    calls = []
    for n in range(size.no_sharing_requests):
        prompt = f"Request {n}. " + words.text(NO_SHARING_PROMPT_TOKENS) + " " + words.question()
        calls.append(([{"role": "user", "content": prompt}], NO_SHARING_ANSWER_TOKENS))
    return await open_loop(send, calls, NO_SHARING_RATE, seed=3)


async def hot_prefix(send: Send, size: Size) -> Run:
    words = Words(seed=4)
    prefix = "You are the assistant everyone uses today. " + words.text(HOT_PROMPT_TOKENS)
    calls = []
    for _ in range(size.hot_requests):
        messages = [
            {"role": "system", "content": prefix},
            {"role": "user", "content": words.question()},
        ]
        calls.append((messages, HOT_ANSWER_TOKENS))
    return await open_loop(send, calls, HOT_RATE, seed=4)


async def preamble(send: Send, size: Size) -> Run:
    words = Words(seed=11)
    opening = "You answer from the document. " + words.text(PREAMBLE_TOKENS)
    calls = []
    for n in range(size.no_sharing_requests):
        document = f"Document {n}. " + words.text(PREAMBLE_DOCUMENT_TOKENS)
        messages = [
            {"role": "system", "content": opening},
            {"role": "user", "content": document + " " + words.question()},
        ]
        calls.append((messages, NO_SHARING_ANSWER_TOKENS))
    return await open_loop(send, calls, PREAMBLE_RATE, seed=11)


async def short_chat(send: Send, size: Size) -> Run:
    words = Words(seed=12)
    system = "You are a terse assistant. " + words.text(SHORT_SYSTEM_TOKENS)
    run = Run()
    gate = asyncio.Semaphore(SHORT_CHATS_AT_ONCE)

    async def chat(n: int) -> None:
        async with gate:
            history: list[Message] = [{"role": "system", "content": system}]
            for _ in range(TURNS):
                history.append({"role": "user", "content": f"Chat {n}. " + words.question(20)})
                outcome = await send(list(history), SHORT_ANSWER_TOKENS)
                run.outcomes.append(outcome)
                if not outcome.ok:
                    return
                history.append({"role": "assistant", "content": outcome.answer})

    started = now()
    await asyncio.gather(*(chat(n) for n in range(size.sessions * 2)))
    run.seconds = now() - started
    return run


async def mixed(send: Send, size: Size) -> Run:
    words = Words(seed=13)
    prompts = [f"Long {n}. " + words.text(3_000) for n in range(4)]
    prompts += [f"Short {n}. " + words.text(400) for n in range(16)]
    calls = []
    for _ in range(size.shared_requests):
        system = prompts[words.rng.randrange(len(prompts))]
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": words.question()},
        ]
        calls.append((messages, MIXED_ANSWER_TOKENS))
    return await closed_loop(send, calls, MIXED_CLIENTS)


WORKLOADS: dict[str, Callable[[Send, Size], Awaitable[Run]]] = {
    "shared": shared,
    "multi-turn": multi_turn,
    "no-sharing": no_sharing,
    "hot-prefix": hot_prefix,
}
# Run when named, no goal on them (module docstring).
MORE_WORKLOADS: dict[str, Callable[[Send, Size], Awaitable[Run]]] = {
    "preamble": preamble,
    "short-chat": short_chat,
    "mixed": mixed,
}
RATES = {"no-sharing": NO_SHARING_RATE, "hot-prefix": HOT_RATE, "preamble": PREAMBLE_RATE}
