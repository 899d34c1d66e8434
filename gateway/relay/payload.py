"""What the gateway reads from request and response bodies, as pure functions over bytes.

The body is forwarded as the client sent it. Only ``model``, ``stream`` and
``stream_options`` decide anything (plus the max-token fields and ``n``, read to reserve tokens
against limits and to answer a wrong type with a 400 that names the field). Two changes are
ever made: a stream whose client did not ask for ``stream_options.include_usage`` gets it
spliced in, because usage is only reported on streams that ask (the extra chunk is hidden
again on the way back, ``SseFilter``); and where a token limit applies, the max-token fields
are bound to what was reserved (``with_output_cap``), so no engine can produce more than was
admitted.

JSON is parsed with orjson (request bodies, usage events), for its lower CPU per body
(docs/decisions.md, 'orjson'). orjson refuses a few documents that Python's json accepts
(``NaN``, lone surrogates, non-UTF-8 encodings) and reads integers past 64 bits as floats; on
a refusal, or such a float where an integer is read, the standard library decides, so a
client sees exactly the answers it saw before.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from gateway.errors import ApiError, bad_field
from gateway.ledger.usage import MAX_COUNT, clamp_count
from gateway.relay.routes import RelayRoute

_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'
_FINISH_RE = re.compile(rb'"finish_reason":\s*"([a-z_]+)"')
_USAGE_KEY = b'"usage"'
# With include_usage on, engines put "usage":null on every chunk; only an object is worth a
# parse (docs/decisions.md, 'usage events parsed only when they carry usage').
_USAGE_OBJECT = re.compile(rb'"usage":\s*\{')
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
# The events that end a Responses API stream; chat-style streams end with ``data: [DONE]``.
_RESPONSE_ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')
_DECODER = json.JSONDecoder()
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_INTEGER_FIELDS = (*MAX_TOKEN_FIELDS, "n")
# The field each route's engines read for the output cap, written when the client sent none.
_CAP_FIELD = {"responses": "max_output_tokens"}
# A stream's relayed bytes kept for counting when the engine reports no usage.
KEEP_BYTES = 4 * 1024 * 1024


def loads(data: bytes) -> Any:
    """Parse JSON as Python's json module would, at orjson's speed where orjson agrees.

    Raises what ``json.loads`` raises (``ValueError``, ``RecursionError``, ...)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


@dataclass(frozen=True)
class Inspected:
    model: str
    stream: bool
    client_wants_usage: bool  # the client asked include_usage itself: show it the usage chunk
    max_tokens: int | None  # the largest max-token field; 0 and null count as absent
    n: int  # choices per prompt times prompts (a batch of completions prompts)
    forward_body: bytes  # what the upstream receives
    usage_added: bool = False  # include_usage was spliced in for the engine
    data: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def for_model(self, name: str) -> Inspected:
        """The same request addressed to ``name`` (an alias or ``name@profile`` resolved to
        the name the engine serves); re-serialized, since the engine must see its own name."""
        if name == self.model:
            return self
        data = dict(self.data)
        data["model"] = name
        if self.usage_added:
            data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
        body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
        return replace(self, model=name, forward_body=body, data=data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def inspect(body: bytes, route: RelayRoute, *, max_items: int) -> Inspected:
    """Parse and check the few fields that matter; raise ``ApiError`` (400) naming the field."""
    if not body:
        raise ApiError(400, "The request body is empty; send a JSON object.", "invalid_json")
    try:
        data = loads(body)
    except RecursionError:
        raise ApiError(400, "The JSON body is nested too deeply.", "invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON.", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", "invalid_json")
    if any(isinstance(data.get(name), float) for name in _INTEGER_FIELDS):
        # orjson reads an integer past 64 bits as a float; Python's json keeps it an integer.
        data = json.loads(body)

    model = data.get("model")
    if model is None:
        raise ApiError(400, "'model' is required.", "missing_required_parameter", param="model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "a non-empty string")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_field("stream", "a boolean")
    if stream and not route.streams:
        raise bad_field("stream", "false for this endpoint")
    max_tokens = None
    for name in MAX_TOKEN_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 0:
            raise bad_field(name, "a non-negative integer")
        # The largest wins, whatever the order: an engine may honour any one of them.
        if value > 0 and (max_tokens is None or value > max_tokens):
            max_tokens = value
    n = data.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise bad_field("n", "a positive integer")
    n *= _prompt_count(data.get("prompt")) if route.kind == "completions" else 1
    for name in ("messages", "input"):
        items = data.get(name)
        if isinstance(items, list) and len(items) > max_items:
            raise ApiError(
                400,
                f"'{name}' has {len(items)} items; at most {max_items} are accepted.",
                "too_many_items",
                param=name,
            )

    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_field("stream_options", "an object")
    wants_usage = bool(options and options.get("include_usage") is True)
    forward = body
    if stream and route.chunked and not wants_usage:
        forward = with_include_usage(body, data)
    return Inspected(model, stream, wants_usage, max_tokens, n, forward, forward is not body, data)


def _prompt_count(prompt: Any) -> int:
    """How many prompts a completions request carries: a list of strings or of token lists is
    a batch, each prompt generating its own choices."""
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        return len(prompt)
    return 1


def with_output_cap(inspected: Inspected, route: RelayRoute, cap: int) -> Inspected:
    """The request with every max-token field it carries no larger than ``cap`` (per choice),
    and the route's own field set to ``cap`` when it carries none: what binds the engine to
    the tokens reserved for it."""
    data = dict(inspected.data)
    if inspected.usage_added:
        data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
    present = [name for name in MAX_TOKEN_FIELDS if data.get(name) is not None]
    changed = False
    for name in present:
        # A 0 means "absent" to the reservation, so it is bound like an absent field.
        if data[name] == 0 or data[name] > cap:
            data[name] = cap
            changed = True
    if not any(data.get(name) for name in present):
        data[_CAP_FIELD.get(route.kind, "max_tokens")] = cap
        changed = True
    if not changed:
        return inspected
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return replace(inspected, forward_body=body, data=data)


def with_include_usage(body: bytes, data: dict[str, Any]) -> bytes:
    """The body with ``stream_options.include_usage`` on. Spliced after the opening brace when
    the client sent no ``stream_options`` (its bytes stay as they were); re-serialized only
    when the client sent options of its own."""
    if "stream_options" not in data:
        start = body.find(b"{")
        return body[: start + 1] + _INCLUDE_USAGE + body[start + 1 :]
    merged = dict(data)
    # "stream_options": null is as good as absent (and must not be spread).
    merged["stream_options"] = {**(data["stream_options"] or {}), "include_usage": True}
    return json.dumps(merged, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Tokens:
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    # The counts the upstream reported outside 0..MAX_COUNT, as reported (for the Event).
    clamped: tuple[tuple[str, str], ...] = ()
    # Whether the engine said how many prompt tokens it found cached (vLLM only does with
    # --enable-prompt-tokens-details, SGLang with --enable-cache-report): routing learns from
    # a report, never from its absence.
    cached_reported: bool = False


def _reported(value: Any) -> int | None:
    """A reported count as an integer, or None when it is not a number (pure). A float counts
    too: orjson reads an integer past 64 bits (``10**23``) as one, and some servers write
    ``12.0``; infinities and NaN come out of range, so they are clamped and noted."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return int(value)
        return MAX_COUNT + 1 if value == math.inf else -1
    return None


def tokens_of(usage: Any) -> Tokens | None:
    """Normalize a usage object: chat/completions/embeddings (prompt_/completion_tokens) and
    the Responses API (input_/output_tokens). Counts are clamped to 0..2^31-1, and cached
    tokens to the prompt's; what was clamped is noted, so an engine reporting nonsense is seen
    rather than trusted."""
    if not isinstance(usage, dict):
        return None
    clamped: list[tuple[str, str]] = []

    def count(name: str, raw: Any, most: int = MAX_COUNT) -> int | None:
        value = _reported(raw)
        if value is None:
            return None
        kept = min(clamp_count(value), most)
        if kept != value:
            clamped.append((name, str(raw)[:40]))
        return kept

    def number(*names: str) -> int:
        for name in names:
            value = count(name, usage.get(name))
            if value is not None:
                return value
        return 0

    prompt = number("prompt_tokens", "input_tokens")
    completion = number("completion_tokens", "output_tokens")
    if prompt == 0 and completion == 0:
        # Embeddings and rerank may report only a total.
        prompt = number("total_tokens")
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    # No engine finds more of a prompt cached than the prompt: past it, the dashboard's hit
    # ratio would pass one and routing would learn the engine holds all of it.
    cached = count(
        "cached_tokens",
        details.get("cached_tokens") if isinstance(details, dict) else None,
        most=prompt,
    )
    return Tokens(prompt, completion, cached or 0, tuple(clamped), cached is not None)


def usage_of_body(body: bytes) -> tuple[Tokens | None, str]:
    """Usage and finish reason of a non-streamed response.

    The usage object is found from the end of the body and decoded alone, so a large embeddings
    response is not parsed whole; anything unexpected falls back to a full parse.
    """
    finish = _finish_of(body)
    at = body.rfind(_USAGE_KEY)
    if at < 0:
        return None, finish
    colon = body.find(b":", at + len(_USAGE_KEY))
    if colon >= 0 and not body[at + len(_USAGE_KEY) : colon].strip():
        try:
            usage, _ = _DECODER.raw_decode(body[colon + 1 :].decode().lstrip())
        except (ValueError, UnicodeDecodeError):
            usage = None
        if isinstance(usage, dict):
            return tokens_of(usage), finish
    try:
        data = loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None, finish
    if isinstance(data, dict):
        found = data.get("usage") or (data.get("response") or {}).get("usage")
        return tokens_of(found), finish
    return None, finish


def _finish_of(data: bytes) -> str:
    match = _FINISH_RE.search(data)
    if match:
        return match.group(1).decode()
    if b'"status":"incomplete"' in data:
        return "length"
    if b'"status":"completed"' in data:
        return "stop"
    return ""


@dataclass
class SseFilter:
    """Relays an SSE stream chunk by chunk, reading usage on the way.

    Chunks are cut at event boundaries so an error event can always be appended cleanly.
    Events are only parsed when they mention usage (a byte search, so relaying costs a few
    microseconds per chunk); the last usage seen wins, which counts usage once whether the
    engine reports it in a final chunk, cumulatively on every chunk, or in
    ``response.completed``/``response.incomplete``.
    """

    hide_usage_chunk: bool
    tokens: Tokens | None = None
    finish_reason: str = ""
    events: int = 0
    # The stream's terminal event was seen. ``data: [DONE]`` itself is held back (``done``):
    # the relay sends it last, after a usage chunk it may have to add.
    terminal: bool = False
    done: bool = False
    # What was relayed (the blocks already in hand, not copies), in case the engine reports
    # no usage and it must be counted; up to KEEP_BYTES.
    blocks: list[bytes] = field(default_factory=list, repr=False)
    kept: int = 0
    _pending: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> bytes:
        """Complete events from this chunk (and any carried over), ready for the client."""
        data = self._pending + chunk if self._pending else chunk
        # Events end in a blank line: "\n\n" (vLLM, SGLang, llama.cpp) or "\r\n\r\n"
        # (servers built on sse-starlette).
        at = data.rfind(b"\n\n")
        end = at + 2 if at >= 0 else 0
        if b"\r" in data:
            at = data.rfind(b"\r\n\r\n")
            end = max(end, at + 4 if at >= 0 else 0)
        if end == 0:
            self._pending = data
            return b""
        complete, self._pending = data[:end], data[end:]
        if self.kept < KEEP_BYTES:
            self.blocks.append(complete)
            self.kept += len(complete)
        self.events += complete.count(b"\n\n") + complete.count(b"\r\n\r\n")
        if _DONE in complete:
            return self._with_usage(complete)
        if b'"response.' in complete and any(end in complete for end in _RESPONSE_ENDS):
            self.terminal = True
        if _USAGE_KEY not in complete or not _USAGE_OBJECT.search(complete):
            # Compact JSON as engines write it; a finish reason is also read from usage events.
            if b'"finish_reason":"' in complete or b'"finish_reason": "' in complete:
                self._note_finish(complete)
            return complete
        return self._with_usage(complete)

    def rest(self) -> bytes:
        """Whatever the upstream sent after its last complete event (normally nothing)."""
        rest, self._pending = self._pending, b""
        return rest

    def _note_finish(self, data: bytes) -> None:
        for match in _FINISH_RE.finditer(data):
            self.finish_reason = match.group(1).decode()

    def _with_usage(self, complete: bytes) -> bytes:
        kept: list[bytes] = []
        for event in _EVENT_END.split(complete)[:-1]:
            if _DONE in event and event.strip() in (b"data: [DONE]", b"data:[DONE]"):
                self.terminal = self.done = True
                self.events -= 1
                continue
            if _USAGE_KEY in event and _USAGE_OBJECT.search(event) and self._read_usage(event):
                continue
            if b'"finish_reason":"' in event or b'"finish_reason": "' in event:
                self._note_finish(event)
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def _read_usage(self, event: bytes) -> bool:
        """Note the usage in one event; True if the event is the extra usage chunk to hide."""
        payload = b"\n".join(
            line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
        )
        try:
            data = loads(payload)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return False
        if not isinstance(data, dict):
            return False
        usage = data.get("usage")
        response = data.get("response")
        if usage is None and isinstance(response, dict):
            usage = response.get("usage")
            status = response.get("status")
            if status == "completed":
                self.finish_reason = self.finish_reason or "stop"
            elif status == "incomplete":
                self.finish_reason = "length"
            elif status == "failed":
                self.finish_reason = "upstream_error"
        tokens = tokens_of(usage)
        if tokens is not None:
            self.tokens = tokens
        for choice in data.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        return self.hide_usage_chunk and tokens is not None and data.get("choices") == []
