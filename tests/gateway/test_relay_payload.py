"""What the relay reads from bodies (``gateway.relay.payload``): pure functions over bytes."""

from __future__ import annotations

import json

import pytest

from gateway.errors import ApiError
from gateway.relay import payload
from gateway.relay.routes import BY_KIND

CHAT = BY_KIND["chat"]


def inspect(body: object, kind: str = "chat") -> payload.Inspected:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return payload.inspect(raw, BY_KIND[kind], max_items=100)


def test_a_plain_request_is_forwarded_byte_for_byte() -> None:
    raw = b'{"model": "m",  "messages": [{"role":"user","content":"\\u00e9"}], "extra": [1]}'
    seen = payload.inspect(raw, CHAT, max_items=100)
    assert seen.forward_body is raw
    assert (seen.model, seen.stream, seen.n, seen.max_tokens) == ("m", False, 1, None)


def test_a_stream_without_stream_options_gets_include_usage_spliced_in() -> None:
    raw = b' {"model":"m","stream":true,"messages":[]}'
    seen = payload.inspect(raw, CHAT, max_items=100)
    assert not seen.client_wants_usage and seen.usage_added
    forwarded = json.loads(seen.forward_body)
    assert forwarded["stream_options"] == {"include_usage": True}
    # Everything the client sent is still there, unchanged.
    assert seen.forward_body.endswith(raw[raw.index(b"{") + 1 :])


def test_a_stream_with_its_own_options_keeps_them_and_adds_include_usage() -> None:
    seen = inspect({"model": "m", "stream": True, "stream_options": {"continuous": 1}})
    assert json.loads(seen.forward_body)["stream_options"] == {
        "continuous": 1,
        "include_usage": True,
    }


def test_null_stream_options_are_replaced_not_spread() -> None:
    seen = inspect({"model": "m", "stream": True, "stream_options": None, "prompt": ""})
    assert json.loads(seen.forward_body)["stream_options"] == {"include_usage": True}


def test_a_client_that_asked_for_usage_is_forwarded_as_is() -> None:
    raw = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True}})
    seen = payload.inspect(raw.encode(), CHAT, max_items=100)
    assert seen.client_wants_usage and not seen.usage_added
    assert seen.forward_body == raw.encode()


def test_responses_streams_are_not_given_stream_options() -> None:
    seen = inspect({"model": "m", "stream": True, "input": "x"}, "responses")
    assert b"stream_options" not in seen.forward_body


def test_an_alias_is_rewritten_to_the_served_name_keeping_include_usage() -> None:
    seen = inspect({"model": "alias", "stream": True, "messages": []}).for_model("real")
    forwarded = json.loads(seen.forward_body)
    assert forwarded["model"] == "real"
    assert forwarded["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "model"),
        ({"model": 1}, "model"),
        ({"model": "m", "stream": 1}, "stream"),
        ({"model": "m", "max_tokens": 1.0}, "max_tokens"),
        ({"model": "m", "max_completion_tokens": False}, "max_completion_tokens"),
        ({"model": "m", "n": "2"}, "n"),
        ({"model": "m", "stream_options": []}, "stream_options"),
        ({"model": "m", "messages": [{}] * 101}, "messages"),
    ],
)
def test_wrong_types_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as error:
        inspect(body)
    assert error.value.status == 400 and error.value.param == param


@pytest.mark.parametrize("raw", [b"", b"[1]", b"{", b"\xff\xfe", b"[" * 50_000 + b"]" * 50_000])
def test_bodies_that_are_not_a_json_object_are_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as error:
        inspect(raw)
    assert error.value.status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","max_tokens":123456789012345678901234567890}',  # past 64 bits
        b'{"model":"m","temperature":NaN}',
        b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',  # lone surrogate
        '{"model":"m"}'.encode("utf-16"),
    ],
)
def test_json_that_python_accepts_is_accepted_as_before(raw: bytes) -> None:
    seen = payload.inspect(raw, CHAT, max_items=100)
    assert seen.model == "m" and seen.forward_body is raw


def test_embeddings_cannot_stream() -> None:
    with pytest.raises(ApiError) as error:
        inspect({"model": "m", "stream": True, "input": "x"}, "embeddings")
    assert error.value.param == "stream"


def test_usage_is_read_from_the_end_of_a_large_body() -> None:
    body = json.dumps(
        {
            "data": [{"embedding": [0.5] * 5000, "text": '"usage": {"prompt_tokens": 999}'}],
            "usage": {"prompt_tokens": 7, "total_tokens": 7},
        }
    ).encode()
    tokens, _ = payload.usage_of_body(body)
    assert tokens == payload.Tokens(prompt=7)


def test_usage_and_finish_of_a_chat_completion() -> None:
    body = json.dumps(
        {
            "choices": [{"finish_reason": "length"}],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        }
    ).encode()
    assert payload.usage_of_body(body) == (
        payload.Tokens(3, 4, 2, cached_reported=True),
        "length",
    )
    # An engine that says nothing of its cache is not taken to have found nothing in it.
    silent = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    tokens, _ = payload.usage_of_body(silent)
    assert tokens is not None and not tokens.cached_reported


def event(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def test_the_extra_usage_chunk_is_hidden_and_counted() -> None:
    sse = payload.SseFilter(hide_usage_chunk=True)
    first = event({"choices": [{"delta": {"content": "a"}}]})
    last = event({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    stream = first + last + usage + b"data: [DONE]\n\n"
    # Fed in awkward pieces: events split across chunks still come out whole.
    out = b"".join(sse.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
    # [DONE] is held back for the relay to send last (after a usage chunk it may add).
    assert out == first + last
    assert sse.done and sse.terminal
    assert sse.tokens == payload.Tokens(5, 2) and sse.finish_reason == "stop"
    assert sse.rest() == b""


def test_the_usage_chunk_is_kept_for_a_client_that_asked() -> None:
    sse = payload.SseFilter(hide_usage_chunk=False)
    usage = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert sse.feed(usage) == usage
    assert sse.tokens == payload.Tokens(5, 2)


def test_usage_on_every_chunk_counts_the_last_not_the_sum() -> None:
    sse = payload.SseFilter(hide_usage_chunk=False)
    for i in range(1, 5):
        sse.feed(
            event(
                {
                    "choices": [{"delta": {"content": "x"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": i},
                }
            )
        )
    assert sse.tokens == payload.Tokens(3, 4)


def test_responses_usage_comes_from_the_final_response_event() -> None:
    sse = payload.SseFilter(hide_usage_chunk=False)
    sse.feed(b"event: response.output_text.delta\n" + event({"delta": "x"}))
    sse.feed(
        b"event: response.incomplete\n"
        + event(
            {
                "type": "response.incomplete",
                "response": {
                    "status": "incomplete",
                    "usage": {"input_tokens": 9, "output_tokens": 4},
                },
            }
        )
    )
    assert sse.tokens == payload.Tokens(9, 4) and sse.finish_reason == "length"


def test_events_ending_in_crlf_are_relayed_as_they_arrive() -> None:
    sse = payload.SseFilter(hide_usage_chunk=True)
    first = b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\r\n\r\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}\r\n\r\n'
    assert sse.feed(first[:10]) == b""
    assert sse.feed(first[10:]) == first
    assert sse.feed(usage + b"data: [DONE]\r\n\r\n") == b""
    assert sse.done and sse.tokens == payload.Tokens(2, 1) and sse.events == 2


def test_a_stream_without_its_terminal_event_is_not_taken_for_a_whole_one() -> None:
    sse = payload.SseFilter(hide_usage_chunk=True)
    sse.feed(event({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}))
    assert not sse.terminal
    responses = payload.SseFilter(hide_usage_chunk=False)
    responses.feed(b"event: response.completed\n" + event({"type": "response.completed"}))
    assert responses.terminal and not responses.done


def inspect_chat(body: dict[str, object]) -> payload.Inspected:
    return payload.inspect(json.dumps(body).encode(), BY_KIND["chat"], max_items=100)


@pytest.mark.parametrize(
    ("fields", "reserved"),
    [
        ({"max_tokens": 100000, "max_completion_tokens": 0}, 100000),
        ({"max_completion_tokens": 0, "max_tokens": 100000}, 100000),
        ({"max_tokens": 5, "max_completion_tokens": 50}, 50),
        ({"max_completion_tokens": 50, "max_tokens": 5}, 50),
        ({"max_tokens": 0}, None),
        ({"max_tokens": None, "max_completion_tokens": 7}, 7),
        ({}, None),
    ],
)
def test_the_largest_max_token_field_counts_and_zero_means_absent(
    fields: dict[str, object], reserved: int | None
) -> None:
    assert inspect_chat({"model": "m", **fields}).max_tokens == reserved


def test_a_batch_of_completions_prompts_multiplies_the_choices() -> None:
    body = b'{"model":"m","prompt":["a","b","c"],"n":2}'
    assert payload.inspect(body, BY_KIND["completions"], max_items=100).n == 6
    tokens = b'{"model":"m","prompt":[1,2,3]}'
    assert payload.inspect(tokens, BY_KIND["completions"], max_items=100).n == 1


@pytest.mark.parametrize(
    ("fields", "sent"),
    [
        ({}, {"max_tokens": 8}),
        ({"max_tokens": 100000, "max_completion_tokens": 0}, {"max_tokens": 8,
                                                              "max_completion_tokens": 8}),
        ({"max_tokens": 3}, {"max_tokens": 3}),
        ({"max_completion_tokens": 20}, {"max_completion_tokens": 8}),
    ],
)  # fmt: skip
def test_the_forwarded_body_is_bound_to_the_reserved_cap(
    fields: dict[str, object], sent: dict[str, int]
) -> None:
    capped = payload.with_output_cap(
        inspect_chat({"model": "m", "stream": True, **fields}), BY_KIND["chat"], 8
    )
    forwarded = json.loads(capped.forward_body)
    assert {k: forwarded[k] for k in payload.MAX_TOKEN_FIELDS if k in forwarded} == sent
    assert forwarded["stream_options"] == {"include_usage": True}


def test_the_responses_api_is_bound_by_its_own_field() -> None:
    body = payload.inspect(b'{"model":"m","input":"x"}', BY_KIND["responses"], max_items=10)
    capped = payload.with_output_cap(body, BY_KIND["responses"], 8)
    assert json.loads(capped.forward_body)["max_output_tokens"] == 8


def test_reported_counts_are_clamped_and_noted() -> None:
    tokens = payload.tokens_of(
        {"prompt_tokens": -5000, "completion_tokens": 10**23, "prompt_tokens_details": None}
    )
    assert tokens is not None
    assert (tokens.prompt, tokens.completion) == (0, 2**31 - 1)
    assert dict(tokens.clamped) == {"prompt_tokens": "-5000", "completion_tokens": str(10**23)}
    assert payload.tokens_of({"prompt_tokens": 3, "completion_tokens": 1}) == payload.Tokens(3, 1)


def test_more_cached_tokens_than_the_prompt_are_clamped_to_the_prompt_and_noted() -> None:
    """An engine that reports more of a prompt cached than the prompt (a bug, or a lie) would
    show a hit ratio past one and teach routing that it holds all of it."""
    for usage in (
        {
            "prompt_tokens": 100,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 5000},
        },
        {
            "input_tokens": 100,
            "output_tokens": 5,
            "input_tokens_details": {"cached_tokens": 5000.0},
        },
    ):
        tokens = payload.tokens_of(usage)
        assert tokens is not None
        assert (tokens.prompt, tokens.cached, tokens.cached_reported) == (100, 100, True)
        assert [name for name, _ in tokens.clamped] == ["cached_tokens"]
    huge = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 10**23}}
    assert payload.tokens_of(huge) == payload.Tokens(
        100, 0, 100, (("cached_tokens", str(10**23)),), True
    )
    honest = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 100}}
    assert payload.tokens_of(honest) == payload.Tokens(100, 0, 100, (), True)


def test_a_streamed_count_past_64_bits_is_clamped_not_zeroed() -> None:
    """orjson reads 10**23 in a usage event as a float; it was taken as no count at all (a
    free prompt, and no Event). Floats are counts too, and out-of-range ones are noted."""
    sse = payload.SseFilter(hide_usage_chunk=False)
    sse.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}\n\n')
    sse.feed(
        b'data: {"choices":[],"usage":{"prompt_tokens":100000000000000000000000,'
        b'"completion_tokens":3}}\n\ndata: [DONE]\n\n'
    )
    assert sse.tokens is not None
    assert (sse.tokens.prompt, sse.tokens.completion) == (2**31 - 1, 3)
    assert [name for name, _ in sse.tokens.clamped] == ["prompt_tokens"]
    tokens = payload.tokens_of(
        {"prompt_tokens": 12.0, "completion_tokens": float("inf"), "total_tokens": float("nan")}
    )
    assert tokens is not None
    assert (tokens.prompt, tokens.completion) == (12, 2**31 - 1)
    assert dict(tokens.clamped) == {"completion_tokens": "inf"}
