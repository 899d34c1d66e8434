"""The relay routes: the ``/v1`` paths that go to an engine, declared once.

Everything else is derived from this table: ``gateway.edge.asgi`` dispatches on ``BY_PATH`` (the
one front door that serves them), the relay posts to the same path on the engine and reads
``streams``/``chunked`` to decide what a body may ask for, and ``gateway.edge.api`` documents
each route as a ninja operation, so the OpenAPI document at ``/v1/openapi.json`` describes
exactly what is served.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelayRoute:
    path: str  # the same on the gateway and on the engine
    kind: str  # the short name recorded as a usage row's endpoint
    summary: str
    tag: str
    # The documented bodies, by their class names in ``gateway.edge.schemas``: documented only
    # (bodies are forwarded as bytes, never validated), so the request path never imports
    # ninja or pydantic (docs/decisions.md, 'Celery, ninja and pydantic imported on first use').
    request: str
    response: str
    streams: bool  # may answer ``"stream": true`` with server-sent events
    chunked: bool  # streams chat-style chunks, so it takes ``stream_options.include_usage``


RELAY_ROUTES: tuple[RelayRoute, ...] = (
    RelayRoute(
        path="/v1/chat/completions",
        kind="chat",
        summary="Create a chat completion",
        tag="generation",
        request="ChatCompletionRequest",
        response="ChatCompletion",
        streams=True,
        chunked=True,
    ),
    RelayRoute(
        path="/v1/completions",
        kind="completions",
        summary="Create a completion",
        tag="generation",
        request="CompletionRequest",
        response="Completion",
        streams=True,
        chunked=True,
    ),
    RelayRoute(
        path="/v1/embeddings",
        kind="embeddings",
        summary="Create embeddings",
        tag="embeddings",
        request="EmbeddingRequest",
        response="EmbeddingList",
        streams=False,
        chunked=False,
    ),
    RelayRoute(
        path="/v1/responses",
        kind="responses",
        summary="Create a response",
        tag="generation",
        request="ResponsesRequest",
        response="ResponseObject",
        streams=True,
        chunked=False,
    ),
    RelayRoute(
        path="/v1/rerank",
        kind="rerank",
        summary="Rerank documents",
        tag="rerank",
        request="RerankRequest",
        response="RerankResult",
        streams=False,
        chunked=False,
    ),
)

BY_PATH: dict[str, RelayRoute] = {route.path: route for route in RELAY_ROUTES}
BY_KIND: dict[str, RelayRoute] = {route.kind: route for route in RELAY_ROUTES}
