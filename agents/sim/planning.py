"""A request validated as vLLM validates it and decided in full when it arrives: its prompts as
tokens, its output length and finish reason, its timing and faults (a :class:`Generation`).

Errors are raised as :class:`HttpError` with vLLM's messages, so a client sees what vLLM says.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any, Final

from agents.sim.config import SimConfig
from agents.sim.http1 import HttpError, Request
from agents.sim.prompts import (
    TEMPLATE_ROOT,
    chat_tokens,
    count_text_tokens,
    id_tokens,
    responses_tokens,
    text_tokens,
)
from agents.sim.wire import Faults, Generation, dumps, embedding_vector, new_id, rerank_score

MAX_CHOICES: Final = 128
KINDS: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/rerank": "rerank",
}
_ID_PREFIXES: Final = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "responses": "resp_",
    "embeddings": "embd-",
    "rerank": "rerank-",
}


def json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as err:
        raise HttpError(400, f"Invalid JSON body: {err}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "The request body must be a JSON object")
    return body


def plan(config: SimConfig, request: Request, body: dict[str, Any], faults: Faults) -> Generation:
    """Validate the request as vLLM would and decide the whole generation up front."""
    kind = KINDS[request.path]
    model = body.get("model")
    if model is None:
        model = config.names[0]
    elif model not in config.names:
        raise HttpError(404, f"The model `{model}` does not exist.")
    base_id = request.headers.get("x-request-id", "")
    if not (0 < len(base_id) <= 128 and base_id.replace("-", "").isalnum()):
        base_id = new_id()  # vLLM adopts the caller's id; only a harmless one here
    job = Generation(kind=kind, model=model, rid=_ID_PREFIXES[kind] + base_id, body=body)
    job.faults = faults
    job.ttft = (config.ttft_ms if faults.ttft_ms is None else faults.ttft_ms) / 1000
    job.itl = (config.itl_ms if faults.itl_ms is None else faults.itl_ms) / 1000
    if kind == "embeddings":
        _plan_embeddings(config, job, body)
        return job
    if kind == "rerank":
        _plan_rerank(job, body)
        return job
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        raise HttpError(400, "Stream options can only be defined when `stream=True`.")
    if options is not None and not isinstance(options, dict):
        raise HttpError(400, "stream_options must be an object")
    job.stream = stream
    job.include_usage = bool(options and options.get("include_usage"))
    job.continuous = bool(job.include_usage and options and options.get("continuous_usage_stats"))
    n = body.get("n", 1) if kind != "responses" else 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise HttpError(400, f"n must be an integer between 1 and {MAX_CHOICES}")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list")
        prompts = [chat_tokens(messages, body.get("tools"))]
        job.prompt_root = TEMPLATE_ROOT
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
    elif kind == "completion":
        prompts = _completion_prompts(body.get("prompt"))
        limit = body.get("max_tokens")
    else:
        if not isinstance(body.get("input"), str | list):
            raise HttpError(400, "input must be a string or a list of items")
        prompts = [responses_tokens(body.get("instructions"), body["input"], body.get("tools"))]
        job.prompt_root = TEMPLATE_ROOT
        limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise HttpError(400, f"max_tokens must be at least 1, got {limit}.")
    longest = max(len(p) for p in prompts)
    room = config.max_model_len - longest
    if room < 1 or (limit is not None and limit > room):
        asked = longest + (limit or 0)
        raise HttpError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. "
            f"However, you requested {asked} tokens ({longest} in the messages, "
            f"{limit or 0} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    natural = faults.output_tokens
    if natural is None:
        if limit is None:
            tokens, finish = config.output_tokens, "stop"
        else:
            tokens, finish = limit, "length"  # like vLLM with ignore_eos: max_tokens it is
    elif limit is not None and limit < natural:
        tokens, finish = limit, "length"
    else:
        tokens, finish = natural, "stop"
    if tokens > room:
        tokens, finish = room, "length"
    _check_fits(config, prompts, tokens)
    job.prompts = prompts
    job.prompt_tokens = sum(len(p) for p in prompts)
    job.tokens, job.finish = tokens, finish
    job.choices = n * len(prompts)
    return job


def _check_fits(config: SimConfig, prompts: list[list[str]], tokens: int) -> None:
    """A batch of prompts whose blocks together outgrow the cache could never be scheduled (one
    prompt always fits: the cache holds ``--max-model-len`` tokens)."""
    size = config.block_size
    need = sum(-(-(len(p) + tokens - 1) // size) for p in prompts)
    if len(prompts) > 1 and need > config.num_gpu_blocks - 1:
        raise HttpError(
            400,
            f"These {len(prompts)} prompts need {need} KV cache blocks together; the cache "
            f"holds {config.num_gpu_blocks - 1}. Send fewer at once.",
        )


def _completion_prompts(prompt: object) -> list[list[str]]:
    """The prompts of a completions request as tokens: one prompt, or a batch of them."""
    if isinstance(prompt, str) and prompt:
        return [text_tokens(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [id_tokens(prompt)]
        prompts = []
        for item in prompt:
            if isinstance(item, str) and item:
                prompts.append(text_tokens(item))
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                prompts.append(id_tokens(item))
            else:
                raise HttpError(400, "Each prompt must be a non-empty string or token list")
        if len(prompts) <= MAX_CHOICES:
            return prompts
    raise HttpError(400, "Either prompt or prompt_embeds must be provided and non-empty.")


def _plan_embeddings(config: SimConfig, job: Generation, body: dict[str, Any]) -> None:
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise HttpError(400, "input must be a string, a list of strings or token ids")
    dim = body.get("dimensions") or config.embedding_dim
    if not isinstance(dim, int) or not 1 <= dim <= 65536:
        raise HttpError(400, "dimensions must be a positive integer")
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for index, item in enumerate(raw):
        if isinstance(item, str):
            text, cost = item, max(1, count_text_tokens(item))
        elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            text, cost = " ".join(map(str, item)), len(item)
        else:
            raise HttpError(400, "input must be a string, a list of strings or token ids")
        job.prompt_tokens += cost
        vector = embedding_vector(text, dim)
        value: object = vector
        if as_base64:  # little-endian float32, which the openai client decodes itself
            value = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": value})
    usage = {
        "prompt_tokens": job.prompt_tokens,
        "total_tokens": job.prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    job.pooled = dumps(
        {
            "id": job.rid,
            "object": "list",
            "created": job.created,
            "model": job.model,
            "data": data,
            "usage": usage,
        }
    )


def _plan_rerank(job: Generation, body: dict[str, Any]) -> None:
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list) or not documents:
        raise HttpError(400, "query must be a string and documents a non-empty list")
    texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
    if not all(isinstance(t, str) for t in texts):
        raise HttpError(400, "documents must be strings or objects with a text")
    top_n = body.get("top_n") or len(texts)
    if not isinstance(top_n, int) or top_n < 0:
        raise HttpError(400, "top_n must be a non-negative integer")
    ranked = sorted(
        ((rerank_score(query, str(t)), i, str(t)) for i, t in enumerate(texts)),
        key=lambda r: (-r[0], r[1]),
    )
    results = [
        {"index": i, "document": {"text": t, "multi_modal": None}, "relevance_score": score}
        for score, i, t in ranked[:top_n]
    ]
    query_cost = count_text_tokens(query)
    job.prompt_tokens = sum(max(1, query_cost + count_text_tokens(str(t))) for t in texts)
    usage = {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens}
    job.pooled = dumps({"id": job.rid, "model": job.model, "usage": usage, "results": results})
