"""The shapes ``/v1`` publishes in its OpenAPI document.

Request bodies are forwarded to the engine as bytes and never validated against these models
(only ``model``, ``stream``, ``stream_options``, ``max_tokens`` and ``n`` are read), so they
document the fields the gateway itself looks at and allow everything else an engine accepts.
Responses are the engine's, relayed; they are described as OpenAI describes them, leniently.
"""

from __future__ import annotations

from typing import Any

from ninja import Schema
from pydantic import ConfigDict, Field


class _Open(Schema):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Schema):
    message: str
    type: str
    code: str | int | None = None
    param: str | None = None


class ErrorResponse(Schema):
    error: ErrorDetail


class StreamOptions(_Open):
    include_usage: bool | None = None


class _GenerationRequest(_Open):
    model: str = Field(
        min_length=1, description="A model name, alias, or name@profile from GET /v1/models."
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1)


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Open):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]


class ResponsesRequest(_Open):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    stream: bool | None = False
    max_output_tokens: int | None = Field(None, ge=0)


class RerankRequest(_Open):
    model: str = Field(min_length=1)
    query: str
    documents: list[str] | list[dict[str, Any]]
    top_n: int | None = Field(None, ge=0)


class Usage(_Open):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class ChatCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage | None = None


class Completion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage | None = None


class EmbeddingList(_Open):
    object: str
    data: list[dict[str, Any]]
    model: str
    usage: Usage | None = None


class ResponseObject(_Open):
    id: str
    object: str
    status: str | None = None
    output: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = None


class RerankResult(_Open):
    id: str | None = None
    model: str | None = None
    results: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ModelCard(Schema):
    id: str
    object: str = "model"
    created: int
    owned_by: str


class ModelList(Schema):
    object: str = "list"
    data: list[ModelCard]


class KeyUsage(Schema):
    key: str = Field(description="The key's visible prefix.")
    period: str
    period_start: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    token_budget: int | None
    budget_left: int | None
