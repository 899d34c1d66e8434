"""Counting tokens when the engine does not: its own tokenizer, asked after the fact, or an
estimate, and which of the two it was.

Engines that report no usage (llama.cpp's server sends none in streams, even under
``stream_options.include_usage``) would otherwise make requests free. So the relay keeps what
it relayed, and when a request ends without usage it is counted here:

- ``tokenized``: the engine's own tokenize endpoint, asked for the prompt and for the text
  relayed back. Three dialects exist and each upstream is asked in turn until one answers
  (remembered for ``DIALECT_TTL_S``): vLLM and SGLang's ``POST /tokenize`` (``prompt`` or chat
  ``messages``, so the chat template is counted too; the ``sim`` engine serves it the same
  way), llama.cpp's ``POST /tokenize`` (``content``), and llama-cpp-python's
  ``POST /extras/tokenize/count`` (``input``), whose chat prompts are counted by the engine
  itself (a one-token completion of the same messages: its tokenizer knows no chat template).
  Where a dialect takes no messages, the prompt is the messages' text joined by newlines.
- ``estimated`` when no tokenizer answers (within ``TOKENIZE_TIMEOUT_S``): a prompt costs one
  token per 4 bytes of UTF-8 text (rounded up) plus 4 per chat message (role and template
  tokens), and a completion one token per content event relayed (engines stream one token per
  event), or one per 4 bytes of text for a whole body.

All of this runs after the answer is relayed, off the request's latency, except for a client
that asked for usage in a stream: it gets one usage chunk with these numbers before
``[DONE]``, as OpenAI's format has it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.ledger.usage import clamp_count
from gateway.relay import payload
from gateway.relay.upstream_client import Pool, UpstreamError
from gateway.routing.table import Upstream

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 2.0
DIALECT_TTL_S = 300.0
MESSAGE_OVERHEAD = 4

VLLM, LLAMACPP, LLAMACPP_PYTHON, NONE = "vllm", "llamacpp", "llamacpp-python", "none"
_HEADERS = b"Content-Type: application/json\r\nAccept: application/json\r\n"

ENGINE, TOKENIZED, ESTIMATED = "engine", "tokenized", "estimated"


@dataclass
class Prompt:
    """What the prompt was, as a tokenizer takes it: chat messages or plain texts."""

    messages: list[dict[str, Any]] | None = None
    texts: list[str] = field(default_factory=list)

    def text(self) -> str:
        if self.messages is not None:
            return "\n".join(_content_text(m.get("content")) for m in self.messages)
        return "\n".join(self.texts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def prompt_of(kind: str, data: dict[str, Any]) -> Prompt:
    """The prompt of a request body (pure): chat messages, completions prompts, Responses
    input and instructions, embeddings input, a rerank query with its documents."""
    if kind == "chat":
        sent = data.get("messages")
        if isinstance(sent, list):
            return Prompt(messages=[m for m in sent if isinstance(m, dict)])
    if kind == "responses":
        messages: list[dict[str, Any]] = []
        if isinstance(data.get("instructions"), str):
            messages.append({"role": "system", "content": data["instructions"]})
        items = data.get("input")
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict):
                content = item.get("content", item.get("output"))
                messages.append({"role": str(item.get("role", "user")), "content": content})
        return Prompt(messages=messages)
    if kind == "rerank":
        docs = data.get("documents")
        texts = [data.get("query")] + (list(docs) if isinstance(docs, list) else [])
        return Prompt(texts=[t if isinstance(t, str) else _content_text([t]) for t in texts])
    raw = data.get("prompt", data.get("input"))
    if isinstance(raw, str):
        return Prompt(texts=[raw])
    if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        return Prompt(texts=list(raw))
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        return Prompt(texts=[" ".join("x" for _ in raw)])  # token ids: one each
    return Prompt()


def estimate_prompt(prompt: Prompt) -> int:
    """One token per 4 bytes of UTF-8 text, rounded up, plus 4 per chat message (pure)."""
    overhead = MESSAGE_OVERHEAD * len(prompt.messages or ())
    texts = [prompt.text()] if prompt.messages is not None else prompt.texts
    return overhead + sum(-(-len(t.encode()) // 4) for t in texts)


# No tokenizer in use packs more text than this into a token on average over a prompt
# (English runs ~4 bytes a token; large vocabularies ~5): a prompt has at least its UTF-8 bytes
# over this many tokens. Deciding "too long for the context" on this floor refuses only what
# the engine would refuse too; prompts near the edge are left for the engine to judge.
FLOOR_BYTES_PER_TOKEN = 8


def prompt_floor(prompt: Prompt) -> int:
    """Tokens the longest single sequence of the prompt takes at least (pure): the chat
    messages together, or the longest of a batch's prompts (each is a sequence of its own)."""
    texts = [prompt.text()] if prompt.messages is not None else prompt.texts
    return max((-(-len(t.encode()) // FLOOR_BYTES_PER_TOKEN) for t in texts), default=0)


@dataclass
class Relayed:
    """What a stream relayed, kept (as the bytes already in hand) in case it must be counted."""

    blocks: list[bytes] = field(default_factory=list)
    content_events: int = 0

    def parsed(self) -> tuple[list[str], dict[str, Any]]:
        """The text of each choice, and the first chunk's id/created/model (for a usage chunk)."""
        texts: dict[int, list[str]] = {}
        head: dict[str, Any] = {}
        events = 0
        for block in self.blocks:
            for line in block.splitlines():
                if not line.startswith(b"data:"):
                    continue
                try:
                    data = payload.loads(line[5:].strip())
                except (ValueError, RecursionError, UnicodeDecodeError):
                    continue
                if not isinstance(data, dict):
                    continue
                if not head and "id" in data:
                    head = {k: data.get(k) for k in ("id", "object", "created", "model")}
                if data.get("type") == "response.output_text.delta":
                    texts.setdefault(0, []).append(str(data.get("delta") or ""))
                    events += 1
                for choice in data.get("choices") or ():
                    if not isinstance(choice, dict):
                        continue
                    piece = _choice_text(choice)
                    if piece:
                        events += 1
                        index = choice.get("index", 0)
                        texts.setdefault(index if isinstance(index, int) else 0, []).append(piece)
        self.content_events = events
        return ["".join(parts) for parts in texts.values()], head


def _choice_text(choice: dict[str, Any]) -> str:
    """The text one choice carries: a chat delta or message (content, reasoning, tool calls)
    or a completion's text; the first of these that has any."""
    for source in (choice.get("delta"), choice.get("message"), choice):
        if not isinstance(source, dict):
            continue
        parts = [
            source[name]
            for name in ("content", "reasoning_content", "text")
            if isinstance(source.get(name), str)
        ]
        for call in source.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                parts += [str(function.get("name") or ""), str(function.get("arguments") or "")]
        if any(parts):
            return "".join(parts)
    return ""


def body_texts(body: bytes) -> list[str]:
    """The generated text of each choice of a whole (non-streamed) answer (pure)."""
    try:
        data = payload.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return []
    if not isinstance(data, dict):
        return []
    texts = [_choice_text(c) for c in data.get("choices") or () if isinstance(c, dict)]
    for item in data.get("output") or ():
        for part in item.get("content") or () if isinstance(item, dict) else ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return texts


# --------------------------------------------------------------------------- the tokenizer


_dialects: dict[str, tuple[str, float]] = {}
_baselines: dict[str, int] = {}


class Tokenizer:
    """An upstream's tokenize endpoint, in whichever dialect it speaks."""

    def __init__(self, pool: Pool, upstream: Upstream, model: str) -> None:
        self.pool = pool
        # The pool calls it as the relay does: with the engine's key (llama-cpp-python guards
        # its tokenize endpoints with it), and only at the addresses the upstream may reach.
        self.upstream = upstream
        self.base_url = upstream.base_url
        self.model = model

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        response = await self.pool.post(
            self.upstream,
            path,
            json.dumps(body, ensure_ascii=False).encode(),
            _HEADERS,
            connect_timeout=TOKENIZE_TIMEOUT_S,
        )
        raw = await response.read()
        response.release()
        try:
            return response.status, payload.loads(raw) if response.status == 200 else None
        except (ValueError, RecursionError, UnicodeDecodeError):
            return response.status, None

    @staticmethod
    def _count(answer: Any) -> int | None:
        if not isinstance(answer, dict):
            return None
        count = answer.get("count")
        if isinstance(count, int) and not isinstance(count, bool):
            return clamp_count(count)
        tokens = answer.get("tokens")
        return len(tokens) if isinstance(tokens, list) else None

    async def _ask(self, dialect: str, *, text: str, messages: list[Any] | None) -> int | None:
        if dialect == VLLM:
            body: dict[str, Any] = {"model": self.model}
            if messages is not None:
                body |= {"messages": messages, "add_generation_prompt": True}
            else:
                body |= {"prompt": text, "add_special_tokens": False}
            status, answer = await self._post("/tokenize", body)
            count = self._count(answer) if status == 200 else None
            if count == 0 and text and isinstance(answer, dict) and "count" not in answer:
                return None  # llama.cpp's /tokenize: it read no "content", so counted nothing
            return count
        if dialect == LLAMACPP:
            status, answer = await self._post("/tokenize", {"content": text})
            return self._count(answer) if status == 200 else None
        status, answer = await self._post("/extras/tokenize/count", {"input": text})
        count = self._count(answer) if status == 200 else None
        if count is None or messages is None:
            return count
        return await self._chat_prompt_tokens(messages) or count

    async def _chat_prompt_tokens(self, messages: list[Any]) -> int | None:
        """llama-cpp-python's tokenize endpoint takes plain text, without the chat template
        (for the tests' model the chat of "hello there" costs 43 tokens, far more than its
        text): the count of a chat prompt comes from the engine itself, a one-token completion
        of the same messages, whose prompt it has just evaluated and mostly holds in its
        prefix cache."""
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "stream": False}
        status, answer = await self._post("/v1/chat/completions", body)
        usage = answer.get("usage") if status == 200 and isinstance(answer, dict) else None
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            return clamp_count(tokens)
        return None

    async def _baseline(self, dialect: str) -> int:
        """Tokens the endpoint adds to any text (llama-cpp-python always adds BOS), taken off a
        completion's count: a completion carries no BOS of its own."""
        if dialect != LLAMACPP_PYTHON:
            return 0
        if self.base_url not in _baselines:
            _baselines[self.base_url] = await self._ask(dialect, text="", messages=None) or 0
        return _baselines[self.base_url]

    async def count(
        self, *, text: str, messages: list[Any] | None = None, completion: bool = False
    ) -> int | None:
        """Tokens of ``text`` (or of chat ``messages``, where the dialect takes them; of a
        completion, without the special tokens a prompt starts with); None when no tokenize
        endpoint answers."""
        known = _dialects.get(self.base_url)
        now = time.monotonic()
        if known is not None and known[1] > now:
            if known[0] == NONE:
                return None
            candidates: Sequence[str] = (known[0],)
        else:
            candidates = (VLLM, LLAMACPP, LLAMACPP_PYTHON)
        for dialect in candidates:
            try:
                async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                    count = await self._ask(
                        dialect, text=text, messages=None if dialect == LLAMACPP else messages
                    )
                    if count is not None and completion:
                        count = max(0, count - await self._baseline(dialect))
            except (TimeoutError, UpstreamError, OSError) as exc:
                logger.info("tokenize on %s failed: %s", self.base_url, type(exc).__name__)
                return None
            if count is not None:
                _dialects[self.base_url] = (dialect, now + DIALECT_TTL_S)
                return count
        _dialects[self.base_url] = (NONE, now + DIALECT_TTL_S)
        return None


@dataclass(frozen=True)
class Counted:
    tokens: payload.Tokens
    source: str


async def count(
    tokenizer: Tokenizer | None,
    prompt: Prompt,
    completions: list[str],
    relayed_events: int | None,
) -> Counted:
    """Prompt and completion tokens of a request whose engine reported none: tokenized if the
    engine's tokenizer answers for both, else estimated (see the module's docstring)."""
    if tokenizer is not None:
        prompt_count = await _count_prompt(tokenizer, prompt)
        completion_count: int | None = 0
        for text in completions:
            if prompt_count is None or completion_count is None:
                break
            if text:
                part = await tokenizer.count(text=text, completion=True)
                completion_count = None if part is None else completion_count + part
        if prompt_count is not None and completion_count is not None:
            return Counted(payload.Tokens(prompt_count, completion_count), TOKENIZED)
    estimate = (
        relayed_events
        if relayed_events is not None
        else sum(-(-len(t.encode()) // 4) for t in completions)
    )
    return Counted(payload.Tokens(estimate_prompt(prompt), estimate), ESTIMATED)


async def _count_prompt(tokenizer: Tokenizer, prompt: Prompt) -> int | None:
    if prompt.messages is not None:
        return await tokenizer.count(text=prompt.text(), messages=prompt.messages)
    total = 0
    for text in prompt.texts:
        part = await tokenizer.count(text=text)
        if part is None:
            return None
        total += part
    return total


def usage_chunk(head: dict[str, Any], tokens: payload.Tokens, kind: str) -> bytes:
    """The one usage chunk a client that asked for usage gets at the end of a stream."""
    usage: dict[str, Any] = {
        "prompt_tokens": tokens.prompt,
        "completion_tokens": tokens.completion,
        "total_tokens": tokens.prompt + tokens.completion,
    }
    if tokens.cached:
        usage["prompt_tokens_details"] = {"cached_tokens": tokens.cached}
    chunk: dict[str, Any] = {
        "id": head.get("id") or "",
        "object": head.get("object")
        or ("chat.completion.chunk" if kind == "chat" else "text_completion"),
        "created": head.get("created") or int(time.time()),
        "model": head.get("model") or "",
        "choices": [],
        "usage": usage,
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


# --------------------------------------------------------------------------- context length

CONTEXT_TTL_S = 600.0
_contexts: dict[tuple[str, str], tuple[int | None, float]] = {}
_learning: set[asyncio.Task[None]] = set()


def context_length(base_urls: Sequence[str], model: str) -> int | None:
    """The model's context length as one of its engines reported it (``max_model_len`` in
    vLLM's, SGLang's and sim's model list), if known (pure lookup)."""
    for base_url in base_urls:
        known = _contexts.get((base_url, model))
        if known is not None and known[0] is not None:
            return known[0]
    return None


def learn_context_length(pool: Pool, upstream: Upstream, model: str) -> None:
    """Ask the engine's model list for the context length, in the background, at most once
    per ``CONTEXT_TTL_S``: the next reservation for a request without a max-token field uses
    it (the context left after the prompt) instead of the default. Asked as the relay asks:
    with the engine's key, only where the upstream's address policy allows."""
    base_url = upstream.base_url
    now = time.monotonic()
    known = _contexts.get((base_url, model))
    if known is not None and known[1] > now:
        return
    _contexts[(base_url, model)] = (known[0] if known else None, now + CONTEXT_TTL_S)
    task = asyncio.get_running_loop().create_task(_learn(pool, upstream, model, now))
    _learning.add(task)
    task.add_done_callback(_learning.discard)


async def _learn(pool: Pool, upstream: Upstream, model: str, now: float) -> None:
    try:
        async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
            response = await pool.post(
                upstream,
                "/v1/models",
                b"",
                b"Accept: application/json\r\n",
                connect_timeout=TOKENIZE_TIMEOUT_S,
                method=b"GET",
            )
            raw = await response.read()
            response.release()
        listed = payload.loads(raw) if response.status == 200 else None
    except (TimeoutError, UpstreamError, OSError, ValueError, RecursionError):
        return
    cards = listed.get("data") if isinstance(listed, dict) else None
    for card in cards if isinstance(cards, list) else ():
        if isinstance(card, dict) and card.get("id") == model:
            length = card.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                _contexts[(upstream.base_url, model)] = (length, now + CONTEXT_TTL_S)
