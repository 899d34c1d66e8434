"""The simulated engine's server: its routes and small endpoints, and each inference request
from arrival to its last byte, with faults.

Each inference request is decided in full when it arrives (``planning.plan``): its prompts as
tokens, its output length, finish reason, timing and faults. An instant request (no timing
flag, no fault that takes time) is then scheduled and answered on the spot, inside the
connection's ``data_received``: its cache lookup, its blocks, its whole answer. Any other is its
connection's task: it waits to be scheduled (``scheduler``), for its prefill, and for each
decoding step, whose length grows with the batch.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
import threading
import time
import zlib
from collections import deque
from dataclasses import replace
from typing import Any, Final

from agents.sim.config import SimConfig
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
from agents.sim.kvcache import BlockPool
from agents.sim.metrics import SimStats, render
from agents.sim.planning import KINDS, json_body, plan
from agents.sim.prompts import chat_tokens
from agents.sim.scheduler import Scheduler, Work, work_for
from agents.sim.wire import (
    HANG_BEFORE_FIRST_BYTE,
    HANG_MID_STREAM,
    NO_FAULTS,
    Faults,
    Generation,
    dumps,
    new_id,
)

log = logging.getLogger("agents.sim")

CRASH_EXIT_CODE: Final = 70  # EX_SOFTWARE: the engine died, as its supervisor sees it
VLLM_VERSION: Final = "0.11.0+sim"
# Paths that need the API key when one is set (vLLM guards /v1 the same way).
_KEYED_PATHS: Final = ("/v1/", "/sim/")
TRACE_CONTEXTS_KEPT: Final = 256


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
        pool = BlockPool(
            config.num_gpu_blocks, config.block_size, caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            pool,
            max_num_seqs=config.seq_limit,
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            clock=time.monotonic,  # the loop's clock once started
        )
        self._rng = random.Random(config.seed)
        self._conns: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._port = 0
        self._ready_at = 0.0
        self._stopping = False
        self._created = int(time.time())
        self._bearer = f"Bearer {config.api_key}".encode()
        # The trace context of the last inference requests that had one (/sim/trace-context).
        self.trace_contexts: deque[dict[str, str]] = deque(maxlen=TRACE_CONTEXTS_KEPT)
        inference = {"POST": self._inference}
        self._routes = {
            "/health": {"GET": self._health},
            "/ping": {"GET": self._health, "POST": self._health},
            "/version": {"GET": self._version},
            "/metrics": {"GET": self._metrics},
            "/v1/models": {"GET": self._models},
            "/sim/faults": {"GET": self._faults, "POST": self._faults, "DELETE": self._faults},
            "/sim/trace-context": {"GET": self._trace_context},
        } | {path: inference for path in KINDS}
        if config.tokenize:
            self._routes["/tokenize"] = {"POST": self._tokenize}

    # ---- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        self.scheduler.clock = loop.time
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
            "sim listening on %s:%d model=%s mode=%s max_num_seqs=%s kv_blocks=%d "
            "block_size=%d prefix_caching=%s startup_delay=%gs",
            self.host,
            self.port,
            ",".join(config.names),
            config.mode,
            config.seq_limit or "unlimited",
            config.num_gpu_blocks,
            config.block_size,
            "on" if config.enable_prefix_caching else "off",
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
        return self.scheduler.num_running

    @property
    def waiting(self) -> int:
        return self.scheduler.num_waiting

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
        body = render(self.config, self.stats, self.scheduler)
        conn.respond(200, body, content_type="text/plain; version=0.0.4; charset=utf-8")

    def _faults(self, conn: Connection, request: Request) -> None:
        if request.method == "POST":
            raw = json_body(request)
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

    def _trace_context(self, conn: Connection, request: Request) -> None:
        conn.respond(200, dumps({"received": list(self.trace_contexts)}))

    def _tokenize(self, conn: Connection, request: Request) -> None:
        """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` (and ``tools``) rendered
        as the chat route renders them; answers the count, the ids and the context length."""
        body = json_body(request)
        self._require_ready()
        model = body.get("model")
        if model is not None and model not in self.config.names:
            raise HttpError(404, f"The model `{model}` does not exist.")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise HttpError(400, "messages must be a list")
            words = chat_tokens(messages, body.get("tools"))
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
        body = json_body(request)
        self._require_ready()
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:  # as vLLM reads it, to join the caller's trace
            received = {"traceparent": traceparent}
            received["tracestate"] = request.headers.get("tracestate", "")
            self.trace_contexts.append(received)
        faults = self._faults_for(body)
        self.stats.inference_requests += 1
        config = self.config
        crash_after = config.crash_after
        if faults.crash or (crash_after and self.stats.inference_requests > crash_after):
            self._crash()
            return
        job = plan(config, request, body, faults)
        if faults.fail is not None:
            self.stats.failed += 1
            headers: tuple[tuple[str, str], ...] = ()
            if faults.retry_after is not None:
                headers = (("retry-after", f"{faults.retry_after:g}"),)
            raise HttpError(
                faults.fail, f"Simulated engine failure ({faults.fail})", headers=headers
            )
        # The flag and the fault override what the cache says (a fault: an engine that lies).
        override = config.cached_tokens if faults.cached_tokens is None else faults.cached_tokens
        instant = not (
            job.ttft
            or job.itl
            or config.itl_ms_per_seq
            or config.prefill_tokens_per_s
            or faults.hang
            or faults.fail_after_tokens is not None
            or faults.end_after_tokens is not None
        )
        if instant:
            cached = self.scheduler.run_now(job.prompts, job.prompt_root, job.tokens, override)
            if cached is not None:
                job.cached = cached
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
                return
        work = work_for(job.prompts, override, job.prompt_root)
        conn.start(self._generate(conn, job, work))

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

    async def _step(self, work: Work, job: Generation, token: int) -> None:
        """Wait until output token ``token`` (1-based) is due: the first after the prefill and
        ``ttft``, each next one decoding step later (longer with more requests running). When
        it returns, the request holds the blocks the token needs; a request preempted meanwhile
        has waited to be scheduled again and for its prefill."""
        scheduler = self.scheduler
        if token == 1:
            due = work.ready_at + job.ttft
        else:
            batch = scheduler.num_running - 1
            due = work.due + job.itl + self.config.itl_ms_per_seq / 1000 * batch
        await _sleep_until(due)
        while not scheduler.grow(work, token):
            await scheduler.resume(work)
        if work.ready_at > due:  # preempted, and computed again since
            due = work.ready_at
            await _sleep_until(due)
        work.due = due
        work.emitted = token

    async def _generate(self, conn: Connection, job: Generation, work: Work) -> None:
        """A paced, queued or faulty generation; the client's disconnect cancels it."""
        faults = job.faults
        try:
            if faults.hang == HANG_BEFORE_FIRST_BYTE:
                await self.scheduler.admit(work)
                await _forever()
            if job.stream:  # vLLM's headers leave before the request is even scheduled
                conn.start_stream()
            await self.scheduler.admit(work)
            job.cached = work.cached
            cut = faults.fail_after_tokens
            if not job.stream:
                if not job.tokens:  # a pooled answer: the prefill is all there is
                    await _sleep_until(work.ready_at + job.ttft)
                for token in range(1, job.tokens + 1):
                    await self._step(work, job, token)
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
                for token in range(1, ended + 1):
                    await self._step(work, job, token)
                    conn.write(frame(job.token_events(token)))
                conn.write(LAST_CHUNK)
                conn.finish()
                self.stats.failed += 1
                return
            if cut == 0:
                await _sleep_until(work.ready_at + job.ttft)
                self.stats.failed += 1
                conn.cut()
                return
            for token in range(1, job.tokens + 1):
                await self._step(work, job, token)
                events = job.token_events(token)
                if token == 1:
                    events = job.open_events() + events
                conn.write(frame(events))
                await conn.drain()
                if faults.hang == HANG_MID_STREAM:
                    await _forever()
                if cut is not None and (token >= cut or token == job.tokens):
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
            self.scheduler.release(work)


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
