"""``sim``: a simulated LLM engine that presents itself exactly as vLLM's OpenAI server does.

It is the upstream for every llmgw test, demo and benchmark, and the engine the node agent
starts where no GPU exists, so a gateway that works against it works against vLLM: the same
paths, JSON shapes (vLLM 0.11: ``chatcmpl-``/``cmpl-``/``embd-`` ids, ``stop_reason``,
``{"error": {...}}`` errors, FastAPI's ``{"detail": ...}`` for 404/405), the same SSE framing
(a role chunk, one content delta per token, ``finish_reason`` on the last token's chunk, the
``choices: []`` usage chunk before ``[DONE]`` under ``stream_options.include_usage``) and the
same Prometheus names (``vllm:num_requests_running`` ...).

Why a raw ``asyncio.Protocol`` HTTP/1.1 server and no framework: the benchmark measures what
llmgw adds over calling the engine directly, so the engine must be far faster than llmgw.
Instant requests are answered inside ``data_received`` without creating a task; only paced,
queued or faulty requests get one. The prefix cache adds its rendering, hashing and block
bookkeeping to every request. What it answers a second and what each request and the cache
cost in CPU were measured: docs/decisions.md, 'the simulated engine'.

Token accounting is a pure function of the request, so tests can predict it: a prompt costs
its whitespace-separated words plus ``MESSAGE_OVERHEAD_TOKENS`` per chat message (and the
words of its ``tools``); the output is ``max_completion_tokens``/``max_tokens`` when given
(finish ``length``) else ``--output-tokens`` (finish ``stop``), cut by ``--max-model-len``;
token *i* is the text ``tok<i>``. The ``/metrics`` counters add up exactly what the usage
objects of successful requests reported (they count a request once its last byte is written);
cancelled and failed requests are counted apart (``sim:request_cancelled_total``,
``sim:request_failed_total``).

The engine has a prefix cache and a queue, as vLLM's: prompts (rendered through a chat
template, ``prompts``) are cut into ``--block-size`` blocks whose hashes chain; a pool of
``--num-gpu-blocks-override`` blocks holds them, evicting least recently used blocks that no
running request holds (``kvcache``); requests run up to ``--max-num-seqs`` at once, wait for
blocks and slots in order, prefill their uncached tokens one at a time at
``--prefill-tokens-per-s`` and decode in steps of ``--itl-ms`` plus ``--itl-ms-per-seq`` for each
other running request (``scheduler``). ``usage.prompt_tokens_details.cached_tokens`` reports
the hits, and ``vllm:prefix_cache_queries``/``_hits``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info`` show the cache (``metrics``).
Without timing flags every request is still answered the moment it arrives, cache and all.

Faults come from the command line (``--fail-rate``, ``--hang-rate``, ``--crash-after``), from a
``"sim": {...}`` object in a request body (``fail``, ``retry_after``, ``hang``,
``fail_after_tokens``, ``ttft_ms``, ``itl_ms``, ``output_tokens``, ``cached_tokens``,
``crash``) and from ``POST /sim/faults`` (the same keys, plus ``times``) for tests that cannot
change the body. ``GET /sim/trace-context`` lists the W3C trace context (``traceparent``,
``tracestate``) of the last inference requests that carried one, newest last: what an engine
that traces (vLLM) would have joined. Standard library only; uvloop is used where it happens
to be importable.

Modules: ``config`` (the flags), ``prompts`` (tokens and the chat template), ``kvcache`` (the
block pool, pure), ``scheduler`` (admission, prefill, preemption), ``planning`` (validation as
vLLM's), ``wire`` (shapes), ``http1`` (the HTTP/1.1 connection), ``metrics`` (``/metrics``),
``engine`` (routes, pacing, faults), ``cli`` (the process).
"""

from agents.sim.cli import main
from agents.sim.config import SimConfig
from agents.sim.engine import CRASH_EXIT_CODE, SimServer, SimThread, serve
from agents.sim.metrics import SimStats
from agents.sim.prompts import (
    MESSAGE_OVERHEAD_TOKENS,
    chat_tokens,
    count_chat_prompt_tokens,
    count_responses_input_tokens,
    count_text_tokens,
)
from agents.sim.wire import Faults, embedding_vector, generated_text, token_text

__all__ = [
    "CRASH_EXIT_CODE",
    "MESSAGE_OVERHEAD_TOKENS",
    "Faults",
    "SimConfig",
    "SimServer",
    "SimStats",
    "SimThread",
    "chat_tokens",
    "count_chat_prompt_tokens",
    "count_responses_input_tokens",
    "count_text_tokens",
    "embedding_vector",
    "generated_text",
    "main",
    "serve",
    "token_text",
]
