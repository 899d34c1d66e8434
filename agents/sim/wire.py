"""What the simulator says on the wire: vLLM's JSON and SSE shapes.

Shapes follow vLLM 0.11's pydantic models as its server dumps them (``model_dump`` for
bodies, ``exclude_unset`` for stream chunks, ``exclude_none`` for the final usage chunk), so
null fields appear where vLLM's appear. Hot shapes are written as string templates rather
than ``json.dumps`` of dicts: a stream is one chunk per token, and the simulator must outrun
the gateway it measures.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Final

HANG_BEFORE_FIRST_BYTE: Final = "before_first_byte"
HANG_MID_STREAM: Final = "mid_stream"
DONE_EVENT: Final = b"data: [DONE]\n\n"

_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def dumps(obj: object) -> bytes:
    """Compact JSON, as FastAPI and pydantic write it."""
    return _encode_json(obj).encode()


def new_id() -> str:
    """vLLM's ``random_uuid()``: 32 hex digits."""
    return os.urandom(16).hex()


# --------------------------------------------------------------------------- generated text


_TOKEN_TEXTS: list[str] = ["", "tok1"]


def token_text(index: int) -> str:
    """The text of generated token ``index`` (1-based), spaced so deltas join into words."""
    while len(_TOKEN_TEXTS) <= index:
        _TOKEN_TEXTS.append(f" tok{len(_TOKEN_TEXTS)}")
    return _TOKEN_TEXTS[index]


@functools.lru_cache(maxsize=256)
def generated_text(tokens: int) -> str:
    """The whole output of ``tokens`` tokens: ``"tok1 tok2 ..."``."""
    return "".join(token_text(i) for i in range(1, tokens + 1))


def embedding_vector(text: str, dim: int) -> list[float]:
    """A unit vector derived from the text alone, rounded to float32 like a real engine's."""
    raw = bytearray()
    counter = 0
    while len(raw) < 2 * dim:
        raw += hashlib.blake2b(f"{counter}:{text}".encode()).digest()
        counter += 1
    values = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{dim}H", bytes(raw[: 2 * dim]))]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return list(struct.unpack(f"<{dim}f", struct.pack(f"<{dim}f", *(v / norm for v in values))))


def rerank_score(query: str, document: str) -> float:
    """Word overlap with the query, so an obviously relevant document wins, plus a stable jitter."""
    query_words = set(query.lower().split())
    overlap = len(query_words & set(document.lower().split())) / max(1, len(query_words))
    jitter = hashlib.blake2b(f"{query}\0{document}".encode(), digest_size=2).digest()
    return round(0.9 * overlap + 0.1 * int.from_bytes(jitter, "big") / 65536, 6)


# --------------------------------------------------------------------------- errors


_ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str) -> bytes:
    """vLLM's ``ErrorResponse`` (OpenAI's shape since vLLM 0.10; ``code`` is the status)."""
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


# --------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class Faults:
    """What to break in one request; unset fields leave the configured behaviour alone."""

    fail: int | None = None
    retry_after: float | None = None
    hang: str | None = None
    fail_after_tokens: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    crash: bool = False
    # Engines that misbehave the way real ones do: report no usage at all (llama.cpp's server
    # in streams), end a stream cleanly after N tokens with no finish and no [DONE], or report
    # a prompt count no row can hold.
    no_usage: bool = False
    end_after_tokens: int | None = None
    report_prompt_tokens: int | None = None

    @classmethod
    def parse(cls, raw: object) -> Faults:
        """The ``"sim"`` object of a body or of ``POST /sim/faults``; ValueError if malformed."""
        if raw is None:
            return NO_FAULTS
        if not isinstance(raw, dict):
            raise ValueError("'sim' must be an object")
        unknown = set(raw) - {f.name for f in fields(cls)} - {"times"}
        if unknown:
            raise ValueError(f"unknown sim keys: {sorted(unknown)}")
        hang = raw.get("hang")
        if hang not in (None, HANG_BEFORE_FIRST_BYTE, HANG_MID_STREAM):
            raise ValueError(f"sim.hang must be {HANG_BEFORE_FIRST_BYTE!r} or {HANG_MID_STREAM!r}")
        crash = raw.get("crash", False)
        if not isinstance(crash, bool):
            raise ValueError("sim.crash must be a boolean")
        no_usage = raw.get("no_usage", False)
        if not isinstance(no_usage, bool):
            raise ValueError("sim.no_usage must be a boolean")
        reported = raw.get("report_prompt_tokens")
        if reported is not None and (isinstance(reported, bool) or not isinstance(reported, int)):
            raise ValueError("sim.report_prompt_tokens must be an integer (any, on purpose)")
        return cls(
            fail=_opt_int(raw, "fail", 400, 599),
            retry_after=_opt_float(raw, "retry_after"),
            hang=hang,
            fail_after_tokens=_opt_int(raw, "fail_after_tokens", 0),
            ttft_ms=_opt_float(raw, "ttft_ms"),
            itl_ms=_opt_float(raw, "itl_ms"),
            output_tokens=_opt_int(raw, "output_tokens", 1),
            cached_tokens=_opt_int(raw, "cached_tokens", 0),
            crash=crash,
            no_usage=no_usage,
            end_after_tokens=_opt_int(raw, "end_after_tokens", 0),
            report_prompt_tokens=reported,
        )

    def over(self, base: Faults) -> Faults:
        """These faults laid over ``base`` key by key (a request's over the process-wide)."""
        if self is NO_FAULTS:
            return base
        changes: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) not in (None, False)
        }
        return replace(base, **changes)

    def as_json(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}


NO_FAULTS: Final = Faults()


def _opt_int(raw: dict[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{key} must be an integer <= {high}")
    return value


def _opt_float(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key} must be a number >= 0")
    return float(value)


# --------------------------------------------------------------------------- generations


@dataclass(eq=False, slots=True)
class Generation:
    """One request, decided up front: what it says, how fast, how it breaks; and its shapes."""

    kind: str  # chat | completion | responses | embeddings | rerank
    model: str
    rid: str
    body: dict[str, Any]
    prompt_tokens: int = 0
    tokens: int = 0  # per choice
    finish: str = "stop"
    choices: int = 1
    cached: int = 0
    stream: bool = False
    include_usage: bool = False
    continuous: bool = False
    ttft: float = 0.0
    itl: float = 0.0
    faults: Faults = NO_FAULTS
    created: int = field(default_factory=lambda: int(time.time()))
    pooled: bytes = b""  # the finished body of an embeddings or rerank request
    prompts: list[list[str]] = field(default_factory=list)  # each prompt's tokens
    prompt_root: int = 0  # the parent hash of their first blocks (a template's, or none)
    seq: int = 0  # the Responses API numbers its stream events
    prefix: str = ""  # a stream chunk up to its choices, built once

    @property
    def completion_tokens(self) -> int:
        return self.tokens * self.choices

    def usage(self, completion: int | None = None, *, final: bool = True) -> str:
        """The usage object. As vLLM's (with ``--enable-prompt-tokens-details``, which the
        simulator always has): ``prompt_tokens_details`` when some prompt tokens were cached,
        none when none were, and never on the per-chunk usage (``final=False``) of
        ``continuous_usage_stats``."""
        done = self.completion_tokens if completion is None else completion
        prompt = self.prompt_tokens
        if self.faults.report_prompt_tokens is not None:
            prompt = self.faults.report_prompt_tokens
        text = (
            f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + done},"completion_tokens":{done}'
        )
        if self.cached and final:
            return text + f',"prompt_tokens_details":{{"cached_tokens":{self.cached}}}}}'
        return text + "}"

    # ---- non-streamed bodies

    def full_body(self) -> bytes:
        if self.kind in ("embeddings", "rerank"):
            return self.pooled
        if self.kind == "responses":
            return dumps(self._response(final=True))
        text = dumps(generated_text(self.tokens)).decode()
        end = f'"finish_reason":"{self.finish}","stop_reason":null,"token_ids":null'
        if self.kind == "chat":
            kind = "chat.completion"
            message = (
                f'"message":{{"role":"assistant","content":{text},"refusal":null,'
                '"annotations":null,"audio":null,"function_call":null,"tool_calls":[],'
                '"reasoning_content":null},"logprobs":null,'
            )
            choices = [f'{{"index":{i},{message}{end}}}' for i in range(self.choices)]
            tail = ',"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":null}'
        else:
            kind = "text_completion"
            extra = ',"prompt_logprobs":null,"prompt_token_ids":null'
            choices = [
                f'{{"index":{i},"text":{text},"logprobs":null,{end}{extra}}}'
                for i in range(self.choices)
            ]
            tail = ',"kv_transfer_params":null}'
        usage = (
            self.usage() if self.cached else self.usage()[:-1] + ',"prompt_tokens_details":null}'
        )
        if self.faults.no_usage:
            usage = "null"
        return (
            f'{{"id":{dumps(self.rid).decode()},"object":"{kind}","created":{self.created},'
            f'"model":{dumps(self.model).decode()},"choices":[{",".join(choices)}],'
            f'"service_tier":null,"system_fingerprint":null,"usage":{usage}{tail}'
        ).encode()

    # ---- streamed events: the opening (sent with the first token), one step per token, the end

    def _chunk(self, choice: str, usage: str | None) -> bytes:
        if not self.prefix:
            kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            self.prefix = (
                f'data: {{"id":{dumps(self.rid).decode()},"object":"{kind}",'
                f'"created":{self.created},"model":{dumps(self.model).decode()},"choices":['
            )
        if usage is not None:
            return f'{self.prefix}{choice}],"usage":{usage}}}\n\n'.encode()
        if self.include_usage:  # vLLM (like OpenAI) then puts a null usage on every chunk
            return f'{self.prefix}{choice}],"usage":null}}\n\n'.encode()
        return f"{self.prefix}{choice}]}}\n\n".encode()

    def _step_usage(self, done: int) -> str | None:
        return (
            self.usage(done, final=False) if self.continuous and not self.faults.no_usage else None
        )

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(payload) + b"\n\n"

    def open_events(self) -> list[bytes]:
        if self.kind == "chat":
            delta = '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null'
            usage = self._step_usage(0)
            return [self._chunk(f'{{"index":{i},{delta}}}', usage) for i in range(self.choices)]
        if self.kind == "responses":
            item = self._message("", "in_progress")
            item["content"] = []
            return [
                self._event("response.created", {"response": self._response(final=False)}),
                self._event("response.in_progress", {"response": self._response(final=False)}),
                self._event("response.output_item.added", {"output_index": 0, "item": item}),
                self._event("response.content_part.added", {**self._where(), "part": _part("")}),
            ]
        return []

    def token_events(self, index: int) -> list[bytes]:
        text = token_text(index)
        if self.kind == "responses":
            where = self._where()
            delta = {**where, "delta": text, "logprobs": []}
            return [self._event("response.output_text.delta", delta)]
        last = index == self.tokens
        finish = f'"{self.finish}","stop_reason":null' if last else "null"
        usage = self._step_usage(index)
        if self.kind == "chat":
            rest = f'"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}'
        else:
            stop = "}" if last else ',"stop_reason":null}'
            rest = f'"text":"{text}","logprobs":null,"finish_reason":{finish}{stop}'
        if self.choices == 1:
            return [self._chunk('{"index":0,' + rest, usage)]
        return [self._chunk(f'{{"index":{i},{rest}', usage) for i in range(self.choices)]

    def close_events(self) -> list[bytes]:
        if self.kind == "responses":
            text = generated_text(self.tokens)
            where = self._where()
            item = self._message(text, "completed")
            return [
                self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**where, "part": _part(text)}),
                self._event("response.output_item.done", {"output_index": 0, "item": item}),
                self._event("response.completed", {"response": self._response(final=True)}),
            ]
        if self.include_usage and not self.faults.no_usage:
            return [self._chunk("", self.usage()), DONE_EVENT]
        return [DONE_EVENT]

    def all_events(self) -> list[bytes]:
        events = self.open_events()
        for i in range(1, self.tokens + 1):
            events += self.token_events(i)
        return events + self.close_events()

    # ---- the Responses API's objects

    def _where(self) -> dict[str, Any]:
        return {"item_id": "msg_" + self.rid[5:], "output_index": 0, "content_index": 0}

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": "msg_" + self.rid[5:],
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_part(text)],
        }

    def _response(self, *, final: bool) -> dict[str, Any]:
        body = self.body
        capped = final and self.finish == "length" and body.get("max_output_tokens") is not None
        status = ("incomplete" if capped else "completed") if final else "in_progress"
        usage = None
        if final:
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.tokens,
            }
        output = [self._message(generated_text(self.tokens), "completed")] if final else []
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if capped else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": usage,
            "user": None,
        }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
