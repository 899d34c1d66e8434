"""The simulated engine: routes, request validation as vLLM does it, pacing, queueing, faults.

Each inference request is decided in full when it arrives (``_plan``): its prompt and output
token counts, finish reason, timing and faults. An instant request is then answered on the
spot; a paced, queued or faulty one becomes its connection's task.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import random
import struct
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Final

from agents.sim.http1 import (
    JSON_TYPE,
    LAST_CHUNK,
    SSE_TYPE,
    Connection,
    HttpError,
    Request,
    detail,
    frame,
    response_head,
)
from agents.sim.wire import (
    HANG_BEFORE_FIRST_BYTE,
    HANG_MID_STREAM,
    MESSAGE_OVERHEAD_TOKENS,
    NO_FAULTS,
    Faults,
    Generation,
    content_words,
    count_chat_prompt_tokens,
    count_responses_input_tokens,
    count_text_tokens,
    dumps,
    embedding_vector,
    new_id,
    rerank_score,
)

log = logging.getLogger("agents.sim")

CRASH_EXIT_CODE: Final = 70  # EX_SOFTWARE: the engine died, as its supervisor sees it
VLLM_VERSION: Final = "0.11.0+sim"
_MAX_CHOICES: Final = 128
# Paths that need the API key when one is set (vLLM guards /v1 the same way).
_KEYED_PATHS: Final = ("/v1/", "/sim/")
_KINDS: Final = {
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


@dataclass(frozen=True)
class SimConfig:
    """The command-line flags as data, so tests and benchmarks start the very same server."""

    model: str = "sim-model"
    served_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; read SimServer.port
    max_model_len: int = 32768
    output_tokens: int = 16
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    max_concurrency: int = 0  # 0: no limit, nothing ever waits
    startup_delay: float = 0.0
    embedding_dim: int = 16
    cached_tokens: int = 0
    fail_rate: float = 0.0
    fail_status: int = 500
    hang_rate: float = 0.0
    crash_after: int = 0  # 0: never
    seed: int | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    shutdown_grace: float = 5.0
    # As vLLM's --api-key: /v1 (and the fault switch) answer 401 without
    # ``Authorization: Bearer <key>``; health, version and metrics stay open.
    api_key: str = ""
    # The CLI exits the process; an in-process server only drops its connections and stops
    # listening, because exiting would take the test runner down with it.
    exit_on_crash: bool = False
    tokenize: bool = True  # serve vLLM's POST /tokenize

    def __post_init__(self) -> None:
        """Refuse a configuration that would make the simulator lie, naming the flag."""
        problems = [
            f"--{name.replace('_', '-')}={getattr(self, name)!r}"
            for name, bad in (
                ("output_tokens", self.output_tokens < 1),
                ("max_model_len", self.max_model_len < 2),
                ("embedding_dim", not 1 <= self.embedding_dim <= 65536),
                ("max_concurrency", self.max_concurrency < 0),
                ("fail_rate", not 0 <= self.fail_rate <= 1),
                ("hang_rate", not 0 <= self.hang_rate <= 1),
                ("fail_status", not 400 <= self.fail_status <= 599),
                ("crash_after", self.crash_after < 0),
                ("ttft_ms", self.ttft_ms < 0),
                ("itl_ms", self.itl_ms < 0),
                ("startup_delay", self.startup_delay < 0),
                ("cached_tokens", self.cached_tokens < 0),
            )
            if bad
        ]
        if problems:
            raise ValueError("invalid simulator settings: " + ", ".join(problems))

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    @property
    def mode(self) -> str:
        if self.ttft_ms or self.itl_ms:
            return f"paced (ttft={self.ttft_ms:g}ms itl={self.itl_ms:g}ms)"
        return "instant"


@dataclass
class SimStats:
    """The counters behind ``/metrics``, for in-process assertions."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=dict)  # by finish reason
    cancelled: int = 0
    failed: int = 0
    inference_requests: int = 0


class _Slots:
    """``--max-concurrency``: requests past the limit wait in arrival order, visibly."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    def try_acquire(self) -> bool:
        if self.waiters or (self.limit and self.running >= self.limit):
            return False
        self.running += 1
        return True

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; running stays the same
                return
        self.running -= 1


async def _sleep_until(deadline: float) -> None:
    delay = deadline - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


class SimServer:
    """A running simulator. Start one with :func:`serve`; ``await close()`` when done."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = SimStats()
        self.faults = NO_FAULTS
        self.faults_times: int | None = None  # None: until changed
        self.crashed = asyncio.Event()
        self._slots = _Slots(config.max_concurrency)
        self._rng = random.Random(config.seed)
        self._conns: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._port = 0
        self._ready_at = 0.0
        self._stopping = False
        self._created = int(time.time())
        self._bearer = f"Bearer {config.api_key}".encode()
        inference = {"POST": self._inference}
        self._routes = {
            "/health": {"GET": self._health},
            "/ping": {"GET": self._health, "POST": self._health},
            "/version": {"GET": self._version},
            "/metrics": {"GET": self._metrics},
            "/v1/models": {"GET": self._models},
            "/sim/faults": {"GET": self._faults, "POST": self._faults, "DELETE": self._faults},
        } | {path: inference for path in _KINDS}
        if config.tokenize:
            self._routes["/tokenize"] = {"POST": self._tokenize}

    # ---- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        self._ready_at = loop.time() + config.startup_delay
        self._server = await loop.create_server(
            lambda: Connection(
                self._dispatch,
                self._conns,
                max_header_bytes=config.max_header_bytes,
                max_body_bytes=config.max_body_bytes,
            ),
            config.host,
            config.port,
            backlog=1024,
        )
        self._port = int(self._server.sockets[0].getsockname()[1])
        log.info(
            "sim listening on %s:%d model=%s mode=%s max_concurrency=%s startup_delay=%gs",
            self.host,
            self.port,
            ",".join(config.names),
            config.mode,
            config.max_concurrency or "unlimited",
            config.startup_delay,
        )
        if config.startup_delay > 0:
            loop.call_later(config.startup_delay, log.info, "sim ready on port %d", self.port)

    @property
    def port(self) -> int:
        """The bound port (the one port 0 picked), still known after close."""
        return self._port

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def ready(self) -> bool:
        return not self._stopping and asyncio.get_running_loop().time() >= self._ready_at

    @property
    def running(self) -> int:
        return self._slots.running

    @property
    def waiting(self) -> int:
        return len(self._slots.waiters)

    async def close(self, grace: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, abort the rest."""
        if self._server is None:
            return
        self._stopping = True
        self._server.close()
        for conn in list(self._conns):
            if conn.task is None and conn.transport is not None:
                conn.transport.close()  # idle keep-alive connections
        tasks = [c.task for c in self._conns if c.task is not None]
        if tasks:
            grace = self.config.shutdown_grace if grace is None else grace
            _, late = await asyncio.wait(tasks, timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()
        await self._server.wait_closed()

    async def __aenter__(self) -> SimServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_faults(self, faults: Faults, times: int | None = None) -> None:
        """Process-wide faults for the next ``times`` inference requests (None: all of them)."""
        self.faults, self.faults_times = faults, times

    def _crash(self) -> None:
        log.error("sim: injected crash")
        if self.config.exit_on_crash:
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            if conn.task is not None:
                conn.task.cancel()
            conn.abort()
        self.crashed.set()

    # ---- routing and the small endpoints

    def _dispatch(self, conn: Connection, request: Request) -> None:
        methods = self._routes.get(request.path)
        if methods is None:
            raise detail(404, "Not Found")
        handler = methods.get(request.method)
        if handler is None:
            raise detail(405, "Method Not Allowed", headers=(("allow", ", ".join(methods)),))
        if self._stopping:
            raise HttpError(503, "The server is shutting down", close=True)
        if self.config.api_key and request.path.startswith(_KEYED_PATHS):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self._bearer):
                raise HttpError(401, "Unauthorized")
        handler(conn, request)

    def _require_ready(self) -> None:
        if not self.ready:
            raise HttpError(503, "The engine is starting up", headers=(("retry-after", "1"),))

    def _health(self, conn: Connection, request: Request) -> None:
        conn.respond(200 if self.ready else 503, b"", content_type=None)

    def _version(self, conn: Connection, request: Request) -> None:
        conn.respond(200, dumps({"version": VLLM_VERSION}))

    def _models(self, conn: Connection, request: Request) -> None:
        self._require_ready()
        permission = {
            "object": "model_permission",
            "created": self._created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.config.max_model_len,
                "permission": [{"id": f"modelperm-{new_id()}", **permission}],
            }
            for name in self.config.names
        ]
        conn.respond(200, dumps({"object": "list", "data": cards}))

    def _metrics(self, conn: Connection, request: Request) -> None:
        label = 'model_name="{}"'.format(
            self.config.names[0].replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        )
        stats = self.stats
        usage = min(1.0, self._slots.running / (self.config.max_concurrency or 256))
        reasons = {"stop": 0, "length": 0, **stats.success}
        families: list[tuple[str, str, str, list[tuple[str, float]]]] = [
            ("vllm:num_requests_running", "gauge", "Requests in execution batches.",
             [(label, self._slots.running)]),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.",
             [(label, self.waiting)]),
            ("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             [(label, usage)]),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             [(label, usage)]),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             [(label, stats.prompt_tokens)]),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
             [(label, stats.generation_tokens)]),
            ("vllm:request_success_total", "counter", "Count of successfully processed requests.",
             [(f'finished_reason="{r}",{label}', n) for r, n in sorted(reasons.items())]),
            ("sim:request_cancelled_total", "counter", "Requests whose client went away first.",
             [(label, stats.cancelled)]),
            ("sim:request_failed_total", "counter", "Requests failed by fault injection.",
             [(label, stats.failed)]),
        ]  # fmt: skip
        lines = []
        for name, kind, doc, samples in families:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {float(value)!r}" for labels, value in samples]
        body = ("\n".join(lines) + "\n").encode()
        conn.respond(200, body, content_type="text/plain; version=0.0.4; charset=utf-8")

    def _faults(self, conn: Connection, request: Request) -> None:
        if request.method == "POST":
            raw = _json_body(request)
            times = raw.get("times")
            if times is not None and (not isinstance(times, int) or times < 1):
                raise HttpError(400, "times must be a positive integer")
            try:
                self.set_faults(Faults.parse(raw), times)
            except ValueError as err:
                raise HttpError(400, str(err)) from None
        elif request.method == "DELETE":
            self.set_faults(NO_FAULTS)
        conn.respond(200, dumps({"faults": self.faults.as_json(), "times": self.faults_times}))

    def _tokenize(self, conn: Connection, request: Request) -> None:
        """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` priced as the chat
        route prices them; answers the count, the ids and the context length."""
        body = _json_body(request)
        self._require_ready()
        model = body.get("model")
        if model is not None and model not in self.config.names:
            raise HttpError(404, f"The model `{model}` does not exist.")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise HttpError(400, "messages must be a list")
            words = [
                w
                for m in messages
                if isinstance(m, dict)
                for w in ["<msg>"] * MESSAGE_OVERHEAD_TOKENS + content_words(m.get("content"))
            ]
        elif isinstance(body.get("prompt"), str):
            words = body["prompt"].split()
        else:
            raise HttpError(400, "Either prompt or messages must be provided.")
        ids = [zlib.crc32(w.encode()) % 32000 for w in words]
        conn.respond(
            200,
            dumps(
                {
                    "count": len(ids),
                    "max_model_len": self.config.max_model_len,
                    "tokens": ids,
                    "token_strs": None,
                }
            ),
        )

    # ---- inference

    def _inference(self, conn: Connection, request: Request) -> None:
        body = _json_body(request)
        self._require_ready()
        faults = self._faults_for(body)
        self.stats.inference_requests += 1
        crash_after = self.config.crash_after
        if faults.crash or (crash_after and self.stats.inference_requests > crash_after):
            self._crash()
            return
        job = self._plan(request, body, faults)
        if faults.fail is not None:
            self.stats.failed += 1
            headers: tuple[tuple[str, str], ...] = ()
            if faults.retry_after is not None:
                headers = (("retry-after", f"{faults.retry_after:g}"),)
            raise HttpError(
                faults.fail, f"Simulated engine failure ({faults.fail})", headers=headers
            )
        instant = not (
            job.ttft
            or job.itl
            or faults.hang
            or faults.fail_after_tokens is not None
            or faults.end_after_tokens is not None
        )
        if instant and self._slots.try_acquire():
            try:
                if job.stream:  # one write, one syscall: head, every event, the last chunk
                    conn.write(
                        response_head(200, SSE_TYPE, None, conn.keep_alive)
                        + frame(job.all_events())
                        + LAST_CHUNK
                    )
                    conn.finish()
                else:
                    conn.respond(200, job.full_body())
                self._record(job)
            finally:
                self._slots.release()
            return
        conn.start(self._generate(conn, job))

    def _faults_for(self, body: dict[str, Any]) -> Faults:
        try:
            own = Faults.parse(body.get("sim"))
        except ValueError as err:
            raise HttpError(400, str(err)) from None
        base = self.faults
        if self.faults_times is not None:
            self.faults_times -= 1
            if self.faults_times <= 0:
                self.faults, self.faults_times = NO_FAULTS, None
        config = self.config
        if config.fail_rate and self._rng.random() < config.fail_rate:
            base = replace(base, fail=config.fail_status)
        elif config.hang_rate and self._rng.random() < config.hang_rate:
            base = replace(base, hang=HANG_BEFORE_FIRST_BYTE)
        return own.over(base)

    def _record(self, job: Generation) -> None:
        """Count a success: the metrics add up exactly what the usage objects reported."""
        stats = self.stats
        stats.prompt_tokens += job.prompt_tokens
        stats.generation_tokens += job.completion_tokens
        stats.success[job.finish] = stats.success.get(job.finish, 0) + 1

    async def _generate(self, conn: Connection, job: Generation) -> None:
        """A paced, queued or faulty generation; the client's disconnect cancels it."""
        faults = job.faults
        loop = asyncio.get_running_loop()
        acquired = False
        try:
            if faults.hang == HANG_BEFORE_FIRST_BYTE:
                await self._slots.acquire()
                acquired = True
                await _forever()
            if job.stream:  # vLLM's headers leave before the request is even scheduled
                conn.start_stream()
            await self._slots.acquire()
            acquired = True
            first = loop.time() + job.ttft
            cut = faults.fail_after_tokens
            if not job.stream:
                await _sleep_until(first + job.itl * max(0, job.tokens - 1))
                body = job.full_body()
                if faults.hang == HANG_MID_STREAM or cut is not None:
                    conn.write(response_head(200, JSON_TYPE, len(body), conn.keep_alive))
                    conn.write(body[: len(body) // 2])
                    if faults.hang == HANG_MID_STREAM:
                        await _forever()
                    self.stats.failed += 1
                    conn.cut()
                    return
                conn.respond(200, body)
                self._record(job)
                return
            ended = faults.end_after_tokens
            if ended is not None and ended < job.tokens:
                # A clean end mid-answer: the last chunk of the body, no finish, no [DONE].
                if ended:
                    conn.write(frame(job.open_events()))
                for i in range(1, ended + 1):
                    await _sleep_until(first + job.itl * (i - 1))
                    conn.write(frame(job.token_events(i)))
                conn.write(LAST_CHUNK)
                conn.finish()
                self.stats.failed += 1
                return
            if cut == 0:
                await _sleep_until(first)
                self.stats.failed += 1
                conn.cut()
                return
            for i in range(1, job.tokens + 1):
                await _sleep_until(first + job.itl * (i - 1))
                events = job.open_events() + job.token_events(1) if i == 1 else job.token_events(i)
                conn.write(frame(events))
                await conn.drain()
                if faults.hang == HANG_MID_STREAM:
                    await _forever()
                if cut is not None and (i >= cut or i == job.tokens):
                    self.stats.failed += 1
                    conn.cut()
                    return
            conn.write(frame(job.close_events()) + LAST_CHUNK)
            conn.finish()
            self._record(job)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        finally:
            if acquired:
                self._slots.release()

    def _plan(self, request: Request, body: dict[str, Any], faults: Faults) -> Generation:
        """Validate the request as vLLM would and decide the whole generation up front."""
        kind = _KINDS[request.path]
        config = self.config
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
            self._plan_embeddings(job, body)
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
        job.continuous = bool(
            job.include_usage and options and options.get("continuous_usage_stats")
        )
        n = body.get("n", 1) if kind != "responses" else 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _MAX_CHOICES:
            raise HttpError(400, f"n must be an integer between 1 and {_MAX_CHOICES}")
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages must be a non-empty list")
            prompts = [count_chat_prompt_tokens(messages)]
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
        elif kind == "completion":
            prompts = _completion_prompts(body.get("prompt"))
            limit = body.get("max_tokens")
        else:
            if not isinstance(body.get("input"), str | list):
                raise HttpError(400, "input must be a string or a list of items")
            prompts = [count_responses_input_tokens(body.get("instructions"), body["input"])]
            limit = body.get("max_output_tokens")
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise HttpError(400, f"max_tokens must be at least 1, got {limit}.")
        longest = max(prompts)
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
        job.prompt_tokens = sum(prompts)
        job.tokens, job.finish = tokens, finish
        job.choices = n * len(prompts)
        cached = config.cached_tokens if faults.cached_tokens is None else faults.cached_tokens
        job.cached = min(cached, job.prompt_tokens)
        return job

    def _plan_embeddings(self, job: Generation, body: dict[str, Any]) -> None:
        raw = body.get("input")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise HttpError(400, "input must be a string, a list of strings or token ids")
        dim = body.get("dimensions") or self.config.embedding_dim
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


def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as err:
        raise HttpError(400, f"Invalid JSON body: {err}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "The request body must be a JSON object")
    return body


def _completion_prompts(prompt: object) -> list[int]:
    """The prompt costs of a completions request: one prompt, or a batch of them."""
    if isinstance(prompt, str) and prompt:
        return [count_text_tokens(prompt) or 1]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [len(prompt)]
        costs = []
        for item in prompt:
            if isinstance(item, str) and item:
                costs.append(count_text_tokens(item) or 1)
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                costs.append(len(item))
            else:
                raise HttpError(400, "Each prompt must be a non-empty string or token list")
        if len(costs) <= _MAX_CHOICES:
            return costs
    raise HttpError(400, "Either prompt or prompt_embeds must be provided and non-empty.")


# --------------------------------------------------------------------------- in-process use


async def serve(config: SimConfig) -> SimServer:
    """Start a simulator on the running loop (port 0 picks a free port: read ``.port``)."""
    server = SimServer(config)
    await server.start()
    return server


class SimThread:
    """A simulator on its own loop in a background thread, for synchronous tests."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.server: SimServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sim", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.server = await serve(self.config)
        except OSError as err:
            self._error = err
            return
        finally:
            self._started.set()
        await self._stop.wait()
        await self.server.close()

    def start(self) -> SimThread:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return self.server.base_url

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    def __enter__(self) -> SimThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
