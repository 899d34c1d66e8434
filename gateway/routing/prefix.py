"""A prompt as the engine's prefix cache sees it: its bytes in template order, cut into blocks.

An engine caches the KV of a prompt in blocks of tokens, each keyed by a hash of the block and
everything before it (vLLM's automatic prefix caching; SGLang's radix tree is the same idea), so
two prompts share cache exactly as far as they share a prefix. The router cannot run the
engine's tokenizer on the request path (it costs more than the rest of the request), and it need
not: prompts that share a prefix of text share the tokens it becomes. So the prompt is written
out as bytes in the order the engine's chat template puts it -- the leading system (and
developer) messages, then the tools, then the conversation -- and cut into blocks; block
``i``'s key is the 64-bit XXH3 hash of its bytes seeded with block ``i-1``'s key, so it stands
for everything before it too. Only full blocks count, as in the engine. The keys are the same
in every process (no per-process hash seed), which lets processes that never talk agree on where
a new prefix goes.

The blocks grow: the first ends at ``FIRST_BLOCK_BYTES`` (256 bytes, some 64 tokens), each next
one where the prompt is twice as long, until they are ``block_bytes`` long
(``LLMGW_ROUTING_BLOCK_BYTES``), then every ``block_bytes``: with the default 1,024, at 256, 512,
1,024, 2,048, 3,072, ... bytes. So a short prompt (a chat's first turns, a short system prompt)
is told apart too, and where two prompts part is told to within ``block_bytes`` (about 256
tokens) however long they are.

Pure: plain data in, plain data out, and cheap: it runs on every request's prompt, and
``make bench`` holds the whole routing decision to a CPU goal (docs/decisions.md, 'prompt
block hash').
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

# Fields of a message that the template renders (beside its role and content).
_MESSAGE_EXTRAS = ("name", "tool_calls", "tool_call_id", "function_call")
_SYSTEM_ROLES = frozenset({"system", "developer"})
# Separators no text of a prompt contains, so "ab"+"c" and "a"+"bc" differ.
_ROLE_END = b"\x1e"
_MESSAGE_END = b"\x1f"
_EMPTY: tuple[int, ...] = ()
# XXH3: faster than zlib.crc32 here (docs/decisions.md, 'prompt block hash'), and 64 bits, so
# keys of different prefixes practically never meet.
_HASH64 = xxhash.xxh3_64_intdigest


# The first block's end; each next block's end doubles until blocks are ``block_bytes`` long.
FIRST_BLOCK_BYTES = 256


@functools.lru_cache(maxsize=16)
def block_ends(block_bytes: int, max_blocks: int) -> tuple[int, ...]:
    """Where each block ends, in bytes of the written-out prompt (module docstring)."""
    ends: list[int] = []
    end = min(FIRST_BLOCK_BYTES, block_bytes)
    while len(ends) < max_blocks:
        ends.append(end)
        end += min(end, block_bytes)
    return tuple(ends)


@dataclass(frozen=True)
class PromptBlocks:
    """The block keys of one prompt, and what routing and learning need with them."""

    keys: tuple[int, ...]  # one per full block, chained: keys[i] covers blocks 0..i
    size: int  # bytes in the written-out prompt (full blocks and the tail)
    ends: tuple[int, ...] = ()  # where each block ends (at least one per key)

    def bytes_through(self, count: int) -> int:
        """How many bytes of the written-out prompt its first ``count`` blocks cover."""
        count = min(count, len(self.keys))
        return self.ends[count - 1] if count > 0 else 0

    def uncached(self, count: int) -> int:
        """The bytes an engine holding its first ``count`` blocks still has to prefill."""
        return max(0, self.size - self.bytes_through(count))

    def blocks_within(self, size: int) -> int:
        """How many of its blocks end within its first ``size`` bytes."""
        return bisect.bisect_right(self.ends, size, 0, len(self.keys))

    @property
    def lead(self) -> int | None:
        """The key processes agree on for a prefix none of them has seen: its first block."""
        return self.keys[0] if self.keys else None


NO_BLOCKS = PromptBlocks(_EMPTY, 0)


def blocks_of(kind: str, data: dict[str, Any], block_bytes: int, max_blocks: int) -> PromptBlocks:
    """The prompt of a ``/v1`` request body (already parsed and checked) as chained block keys.

    ``kind`` is the relay route's kind. Embeddings and rerank requests keep no KV cache between
    requests, and a body whose prompt is not where the API puts it has no blocks: both are
    routed by load alone. At most ``max_blocks`` are keyed, so a huge prompt costs no more
    than that many blocks' hashes (its tail still shares or not; it is just not told apart).
    """
    try:
        written = _written(kind, data)
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return NO_BLOCKS
    if not written:
        return NO_BLOCKS
    return chain(written, block_bytes, max_blocks)


def chain(written: bytes, block_bytes: int, max_blocks: int) -> PromptBlocks:
    """Block keys of bytes: each full block hashed with the key before it as its seed."""
    view = memoryview(written)
    size = len(written)
    ends = block_ends(block_bytes, max_blocks)
    keys: list[int] = []
    append = keys.append
    key = start = 0
    hash64 = _HASH64
    for end in ends:
        if end > size:
            break
        key = hash64(view[start:end], key)
        append(key)
        start = end
    return PromptBlocks(tuple(keys), size, ends)


def _written(kind: str, data: dict[str, Any]) -> bytes:
    if kind == "chat":
        return _chat(data.get("messages"), data.get("tools"))
    if kind == "completions":
        return _text(data.get("prompt"))
    if kind == "responses":
        head = _text(data.get("instructions"))
        return head + _chat(data.get("input"), data.get("tools"))
    return b""


def _chat(messages: Any, tools: Any) -> bytes:
    """Messages in template order: the leading system messages, the tools, the rest."""
    if isinstance(messages, str):  # the Responses API's plain-text input
        return _text(messages)
    if not isinstance(messages, list):
        return b""
    lead = 0
    while (
        lead < len(messages)
        and isinstance(messages[lead], dict)
        and messages[lead].get("role") in _SYSTEM_ROLES
    ):
        lead += 1
    parts: list[bytes] = []
    _messages(parts, messages[:lead])
    if tools:
        parts.append(b"tools" + _ROLE_END + orjson.dumps(tools) + _MESSAGE_END)
    _messages(parts, messages[lead:])
    return b"".join(parts)


def _messages(parts: list[bytes], messages: list[Any]) -> None:
    """Each message's bytes onto ``parts`` (its role, its content, the fields the template
    renders beside them), one list for the whole prompt: a long chat has dozens of messages on
    every request."""
    add = parts.append
    for message in messages:
        if not isinstance(message, dict):
            add(orjson.dumps(message))
            add(_MESSAGE_END)
            continue
        role = message.get("role")
        add(role.encode() if isinstance(role, str) else b"")
        add(_ROLE_END)
        content = message.get("content")
        add(content.encode() if type(content) is str else _content(content))
        if len(message) > 2:  # more than a role and its content (most messages are just those)
            for extra in _MESSAGE_EXTRAS:
                value = message.get(extra)
                if value is not None:
                    add(_ROLE_END + extra.encode() + _ROLE_END + _text(value))
        add(_MESSAGE_END)


def _content(content: Any) -> bytes:
    """A message's content: a string, or parts (text parts as their text, others as JSON)."""
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, list):
        return b"".join(_part(p) for p in content)
    return _text(content)


def _part(part: Any) -> bytes:
    if isinstance(part, dict):
        text = part.get("text")
        if isinstance(text, str) and part.get("type") in ("text", "input_text", "output_text"):
            return text.encode()
    return orjson.dumps(part)


def _text(value: Any) -> bytes:
    """A string as its bytes; token ids and anything else as JSON (the same value, the same
    bytes: orjson writes dict keys in their given order)."""
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    return orjson.dumps(value)


def covering(blocks: PromptBlocks, tokens_cached: int, prompt_tokens: int) -> int:
    """How many of ``blocks`` an engine's report of cached tokens covers: the share of the
    prompt's tokens it found cached, as a share of the written-out bytes, in full blocks."""
    if prompt_tokens <= 0 or tokens_cached <= 0 or not blocks.keys:
        return 0
    share = min(1.0, tokens_cached / prompt_tokens)
    return blocks.blocks_within(int(share * blocks.size))
