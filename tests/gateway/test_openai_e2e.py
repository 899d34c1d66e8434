"""The official ``openai`` client against a live llmgw web process, in front of live ``sim``
engines: what a user sees, and the usage rows it leaves behind (G1, G3, G4, G7, G14, U5, U7)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import openai
import pytest
from django.utils import timezone

from control.models import Replica, ServedModel
from gateway.identity import keys
from gateway.models import ApiKey
from tests.harness.factories import make_key, serve_model, usage_rows
from tests.harness.live import Stack, gateway_stack, http, sim_metrics, wait_for_rows
from tests.harness.procs import Proc
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODELS = ("chat-a", "chat-b", "chat-c", "emb", "cold")


@pytest.fixture(scope="module")
def live(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = {"LLMGW_KEEPALIVE_INTERVAL": "0.2"}
    with gateway_stack(
        tmp_path_factory.mktemp("openai-e2e"), MODELS, settings=lambda _: settings
    ) as live:
        yield live


@pytest.fixture
def stack(live: Stack) -> Iterator[tuple[Proc, Proc, Proc]]:
    live.begin()
    yield live.web, live.engines[0], live.engines[1]
    live.settle()


def client(web: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=60)


def listed(web: Proc, key: str) -> list[str]:
    return [m.id for m in client(web, key).models.list().data]


def serving(web: Proc, key: str, name: str, *sims: Proc, **fields: Any) -> Any:
    """Serve ``name`` and wait until the web process routes it. The earlier tests' rows for the
    same name were deleted, so first wait until the web process's table shows that (it
    refreshes every 0.1 s): otherwise a stale entry could pass for the new one."""
    wait_until(lambda: name not in listed(web, key))
    served = serve_model(name, [s.port for s in sims], **fields)
    wait_until(lambda: name in listed(web, key))
    return served


def test_models_list_shows_only_what_the_key_may_use(stack: Any) -> None:
    web, sim_a, _ = stack
    key, _ = make_key()
    narrow, _ = make_key(models=["chat-b"])
    serving(web, key, "chat-a", sim_a)
    serving(web, key, "chat-b", sim_a)
    assert {m.id for m in client(web, key).models.list().data} >= {"chat-a", "chat-b"}
    assert [m.id for m in client(web, narrow).models.list().data] == ["chat-b"]


def test_chat_completion_relays_the_engine_answer_and_records_its_usage(stack: Any) -> None:
    web, sim_a, _ = stack
    key, api_key = make_key()
    serving(web, key, "chat-a", sim_a)
    reply = client(web, key).chat.completions.create(
        model="chat-a", messages=[{"role": "user", "content": "one two three"}], max_tokens=5
    )
    assert reply.choices[0].message.content == "tok1 tok2 tok3 tok4 tok5"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    (row,) = wait_for_rows(api_key, 1)
    assert (row.model, row.status, row.stream, row.endpoint) == ("chat-a", 200, False, "chat")
    assert (row.prompt_tokens, row.completion_tokens) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )
    assert row.finish_reason == "length"
    assert row.upstream.startswith("replica:")
    assert row.user_id == api_key.user_id


def test_stream_hides_the_usage_chunk_it_asked_for_but_still_counts_it(stack: Any) -> None:
    """U5: include_usage is requested upstream on every stream; a client that did not ask
    sees no usage chunk, and the row has the engine's numbers."""
    web, sim_a, _ = stack
    key, api_key = make_key()
    serving(web, key, "chat-a", sim_a)
    chunks = list(
        client(web, key).chat.completions.create(
            model="chat-a",
            messages=[{"role": "user", "content": "a b"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # the `choices: []` usage chunk was dropped
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "tok1 tok2 tok3 tok4"
    (row,) = wait_for_rows(api_key, 1)
    assert row.stream and row.completion_tokens == 4 and row.prompt_tokens > 0
    assert row.ttft_ms is not None and row.ttft_ms <= row.duration_ms


def test_stream_that_asked_for_usage_gets_the_chunk_once(stack: Any) -> None:
    web, sim_a, _ = stack
    key, api_key = make_key()
    serving(web, key, "chat-a", sim_a)
    chunks = list(
        client(web, key).chat.completions.create(
            model="chat-a",
            messages=[{"role": "user", "content": "a b c"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0].choices == []
    (row,) = wait_for_rows(api_key, 1)
    reported = with_usage[0].usage
    assert reported is not None
    assert row.completion_tokens == reported.completion_tokens == 3
    assert row.prompt_tokens == reported.prompt_tokens


def test_usage_reported_on_every_chunk_is_counted_once(stack: Any) -> None:
    """U5: vLLM's continuous usage stats put cumulative usage on every chunk."""
    web, sim_a, _ = stack
    key, api_key = make_key()
    serving(web, key, "chat-a", sim_a)
    body = {
        "model": "chat-a",
        "messages": [{"role": "user", "content": "x y"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    status, _, raw = http(
        "POST", web.url + "/v1/chat/completions", key=key, body=json.dumps(body).encode()
    )
    assert status == 200
    reported = [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")
    ]
    last = [c["usage"] for c in reported if c.get("usage")][-1]
    (row,) = wait_for_rows(api_key, 1)
    assert row.completion_tokens == last["completion_tokens"] == 6
    assert row.prompt_tokens == last["prompt_tokens"]


def test_completions_embeddings_and_responses_go_through(stack: Any) -> None:
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    serving(web, key, "chat-a", sim_a, sim_b)
    serving(web, key, "emb", sim_b)
    api = client(web, key)
    completion = api.completions.create(model="chat-a", prompt="say something", max_tokens=2)
    assert completion.choices[0].text == "tok1 tok2"
    streamed = list(api.completions.create(model="chat-a", prompt="p", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "tok1 tok2 tok3"
    vectors = api.embeddings.create(model="emb", input=["first text", "second"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 16
    response = api.responses.create(model="chat-a", input="hello there", max_output_tokens=3)
    assert response.usage is not None and response.usage.output_tokens == 3
    events = list(
        api.responses.create(model="chat-a", input="hi", max_output_tokens=2, stream=True)
    )
    completed = [e for e in events if e.type == "response.completed"]
    assert len(completed) == 1
    rows = wait_for_rows(api_key, 5)
    by_endpoint = {(r.endpoint, r.stream): r for r in rows}
    assert by_endpoint[("completions", False)].completion_tokens == 2
    assert by_endpoint[("completions", True)].completion_tokens == 3
    assert by_endpoint[("embeddings", False)].prompt_tokens == vectors.usage.prompt_tokens
    assert by_endpoint[("responses", False)].completion_tokens == 3
    streamed_response = by_endpoint[("responses", True)]
    final_usage = completed[0].response.usage
    assert final_usage is not None
    assert streamed_response.completion_tokens == final_usage.output_tokens
    assert streamed_response.prompt_tokens == final_usage.input_tokens


def test_recorded_tokens_equal_what_the_engines_reported(stack: Any) -> None:
    """U7: across both engines and every kind of request, Σ rows = Σ engine counters."""
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    serving(web, key, "chat-c", sim_a, sim_b)
    before = [sim_metrics(s) for s in (sim_a, sim_b)]
    api = client(web, key)
    for i in range(6):
        api.chat.completions.create(
            model="chat-c",
            messages=[{"role": "user", "content": "w " * (i + 1)}],
            max_tokens=i + 1,
        )
        list(
            api.chat.completions.create(
                model="chat-c",
                messages=[{"role": "user", "content": "s " * i}],
                stream=True,
            )
        )
    after = [sim_metrics(s) for s in (sim_a, sim_b)]

    def engine_total(name: str) -> float:
        return sum(a.get(name, 0) - b.get(name, 0) for a, b in zip(after, before, strict=True))

    rows = wait_for_rows(api_key, 12)
    assert len(rows) == 12
    assert sum(r.prompt_tokens for r in rows) == engine_total("vllm:prompt_tokens_total")
    assert sum(r.completion_tokens for r in rows) == engine_total("vllm:generation_tokens_total")
    # Both replicas took traffic (least outstanding, rotating ties).
    assert len({r.upstream for r in rows}) == 2


def test_error_statuses_surface_as_the_clients_exception_classes(stack: Any) -> None:
    web, sim_a, _ = stack
    key, _ = make_key()
    narrow, _ = make_key(models=["chat-b"])
    limited, _ = make_key(rpm=1)
    serving(web, key, "chat-a", sim_a)
    message: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as auth:
        client(web, "llmgw-" + "x" * 43).chat.completions.create(model="chat-a", messages=message)
    assert auth.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        client(web, key).chat.completions.create(model="no-such-model", messages=message)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError):
        client(web, narrow).chat.completions.create(model="chat-a", messages=message)
    with pytest.raises(openai.BadRequestError) as bad:
        client(web, key).chat.completions.create(model="chat-a", messages=message, n=0)
    assert bad.value.param == "n"
    client(web, limited).chat.completions.create(model="chat-a", messages=message)
    with pytest.raises(openai.RateLimitError) as limited_error:
        client(web, limited).chat.completions.create(model="chat-a", messages=message)
    assert int(limited_error.value.response.headers["Retry-After"]) >= 1
    # The engine's own 4xx is relayed as it is (vLLM's shape), also a BadRequestError.
    with pytest.raises(openai.BadRequestError):
        client(web, key).chat.completions.create(model="chat-a", messages=[])


def test_bad_keys_get_401_without_reaching_an_engine_or_echoing_the_key(stack: Any) -> None:
    """G1: missing, malformed, unknown, revoked and expired keys."""
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    expired, expired_row = make_key()
    serving(web, key, "chat-a", sim_a)
    ApiKey.objects.filter(pk=expired_row.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    revoked, revoked_row = make_key()
    # Warm the cache first: revocation must still be seen within the cache TTL.
    assert http("GET", web.url + "/v1/models", key=revoked)[0] == 200
    assert keys.revoke(revoked_row.pk)
    before = [sim_metrics(s)["vllm:request_success_total"] for s in (sim_a, sim_b)]
    body = json.dumps({"model": "chat-a", "messages": [{"role": "user", "content": "x"}]})
    # Revocation is honoured once the web process's key cache (0.3 s here) has let go.
    wait_until(
        lambda: http("GET", web.url + "/v1/models", key=revoked)[0] == 401,
        what="the revoked key refused",
    )
    candidates = {
        "missing": None,
        "malformed": "not-a-key",
        "unknown": "llmgw-" + "A" * 43,
        "revoked": revoked,
        "expired": expired,
    }
    for label, candidate in candidates.items():
        headers = {} if candidate is None else {"Authorization": f"Bearer {candidate}"}
        status, _, raw = http(
            "POST", web.url + "/v1/chat/completions", body=body.encode(), headers=headers
        )
        assert status == 401, label
        error = json.loads(raw)["error"]
        assert error["code"] == "invalid_api_key", label
        assert candidate is None or candidate not in raw.decode(), label
    after = [sim_metrics(s)["vllm:request_success_total"] for s in (sim_a, sim_b)]
    assert after == before
    assert usage_rows(api_key) == []


def test_a_key_cannot_read_another_keys_usage(stack: Any) -> None:
    """G3: B's prefix through A's key is 404 — the same answer as for no key at all."""
    web, sim_a, _ = stack
    key_a, _ = make_key("alice")
    key_b, row_b = make_key("bob", budget=1000)
    serving(web, key_a, "chat-a", sim_a)
    client(web, key_b).chat.completions.create(
        model="chat-a", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    wait_for_rows(row_b, 1)
    status, _, raw = http("GET", f"{web.url}/v1/keys/{row_b.prefix}/usage", key=key_a)
    assert status == 404 and row_b.prefix not in raw.decode()
    assert http("GET", f"{web.url}/v1/keys/llmgw-nonexist/usage", key=key_a)[0] == 404
    status, _, raw = http("GET", f"{web.url}/v1/keys/{row_b.prefix}/usage", key=key_b)
    summary = json.loads(raw)
    assert status == 200 and summary["requests"] == 1
    assert summary["budget_left"] == 1000 - summary["prompt_tokens"] - summary["completion_tokens"]


def test_client_supplied_upstreams_and_keys_change_nothing(stack: Any) -> None:
    """G4: api_base, base_url, api_key in the body or headers, and a URL as the model."""
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    serving(web, key, "chat-b", sim_b)
    before = sim_metrics(sim_b)["vllm:request_success_total"]
    body = {
        "model": "chat-b",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "api_base": sim_a.url,
        "base_url": "http://169.254.169.254/",
        "api_key": "sk-x",
    }
    status, _, raw = http(
        "POST",
        web.url + "/v1/chat/completions",
        key=key,
        body=json.dumps(body).encode(),
        headers={"X-Api-Base": sim_a.url, "OpenAI-Base-URL": sim_a.url, "Host": "evil.example"},
    )
    assert status == 200, raw
    assert sim_metrics(sim_b)["vllm:request_success_total"] == before + 1
    (row,) = wait_for_rows(api_key, 1)
    assert row.upstream == f"replica:{ServedModel.objects.get(name='chat-b').replicas.get().pk}"
    for model in (sim_a.url + "/v1", "file:///etc/passwd", "http://169.254.169.254/latest"):
        with pytest.raises(openai.NotFoundError):
            client(web, key).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}]
            )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", 42),
        ("model", ""),
        ("stream", "yes"),
        ("max_tokens", "10"),
        ("max_tokens", -1),
        ("n", 1.5),
        ("n", True),
    ],
)
def test_wrong_types_are_400_naming_the_field(stack: Any, field: str, value: Any) -> None:
    """G7."""
    web, _, _ = stack
    key, _ = make_key()
    body = {"model": "chat-a", "messages": [{"role": "user", "content": "x"}], field: value}
    status, _, raw = http(
        "POST", web.url + "/v1/chat/completions", key=key, body=json.dumps(body).encode()
    )
    assert status == 400
    assert json.loads(raw)["error"]["param"] == field


def test_unknown_model_is_404_and_a_cold_model_503_after_its_activation_timeout(
    stack: Any,
) -> None:
    """G14, and demand recorded for the reconciler."""
    web, sim_a, _ = stack
    key, api_key = make_key()
    served = serving(web, key, "cold", sim_a, ready=False, activation_timeout_s=1)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as unavailable:
        client(web, key).chat.completions.create(
            model="cold", messages=[{"role": "user", "content": "x"}]
        )
    assert unavailable.value.status_code == 503
    assert int(unavailable.value.response.headers["Retry-After"]) >= 1
    assert time.monotonic() - started >= 0.9  # it waited for the activation bound first
    served.model.refresh_from_db()
    assert served.model.demand_at is not None
    (row,) = wait_for_rows(api_key, 1)
    assert row.status == 503


def test_a_request_waits_for_a_cold_model_and_goes_through_when_it_is_ready(stack: Any) -> None:
    """Activation: the stream stays open with `: waiting` comments until a replica is ready."""
    web, sim_a, _ = stack
    key, api_key = make_key()
    served = serving(web, key, "cold", sim_a, ready=False, activation_timeout_s=60)
    body = {
        "model": "cold",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "stream": True,
    }
    conn = HTTPConnection("127.0.0.1", web.port, timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    response = conn.getresponse()
    status = response.status
    first = response.readline()  # the request is held, and the client is told so
    # The demand is stamped by the process's next batch of stamps, not before the first byte.
    wait_until(
        lambda: ServedModel.objects.get(pk=served.model.pk).demand_at is not None,
        what="the held request's demand recorded",
    )
    Replica.objects.filter(pk=served.replicas[0].pk).update(observed=Replica.Observed.READY)
    raw = first + response.read()
    conn.close()
    assert status == 200
    assert raw.startswith(b": waiting\n\n")
    assert b'"content":" tok2"' in raw
    assert raw.rstrip().endswith(b"data: [DONE]")
    (row,) = wait_for_rows(api_key, 1)
    assert row.completion_tokens == 2 and row.status == 200


def test_alias_and_profile_names_reach_the_engine_under_its_own_name(stack: Any) -> None:
    web, sim_a, _ = stack
    key, api_key = make_key()
    served = serving(web, key, "chat-a", sim_a, aliases=["friendly"])
    profile = served.model.default_profile.name
    for name in ("friendly", f"chat-a@{profile}"):
        reply = client(web, key).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        assert reply.model == "chat-a"
    rows = wait_for_rows(api_key, 2)
    assert {r.model for r in rows} == {"chat-a"}
    with pytest.raises(openai.NotFoundError):
        client(web, key).chat.completions.create(
            model="chat-a@no-such-profile", messages=[{"role": "user", "content": "x"}]
        )


def test_openapi_document_describes_the_routes(stack: Any) -> None:
    web, _, _ = stack
    status, _, raw = http("GET", web.url + "/v1/openapi.json")
    document = json.loads(raw)
    assert status == 200
    assert {
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/rerank",
    } <= set(document["paths"])
    chat = document["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.rsplit("/", 1)[-1] in document["components"]["schemas"]
    assert {"200", "401", "404", "429"} <= set(chat["responses"])


def test_no_key_appears_in_any_log(stack: Any, tmp_path: Path) -> None:
    """G15 for this module's web process: run last in the module, after every test above."""
    web, sim_a, _ = stack
    key, _ = make_key()
    serving(web, key, "chat-a", sim_a)
    client(web, key).chat.completions.create(
        model="chat-a", messages=[{"role": "user", "content": "x"}]
    )
    http("GET", web.url + "/v1/models", headers={"Authorization": f"Bearer {key}x"})
    log = web.log()
    assert key not in log and key[6:20] not in log
    assert "Bearer" not in log and "Authorization" not in log
