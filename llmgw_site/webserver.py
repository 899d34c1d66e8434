"""One web process: uvicorn (uvloop + httptools, WebSockets for the agents' streams) on the
listening sockets ``manage.py run`` binds and hands down.

Chosen by measurement (``make bench``, the server rows): uvicorn with uvloop and httptools
spends the least CPU per request of the servers measured side by side, and CPU per request is
what bounds a web process's throughput (docs/decisions.md, 'web server'). It serves Channels'
WebSocket consumers as well, so one kind of process carries every listener: against daphne on
the agents' streams it took a storm of dialling nodes with less CPU and memory, which its
slightly higher cost on steady heartbeats does not outweigh (docs/decisions.md, 'agent
streams on the web server').

Several of them accept on one shared socket (not ``SO_REUSEPORT``): a connection waiting in
the backlog is taken by whichever process is accepting, so a process that stops accepting
loses none.

A stop (SIGTERM, or Ctrl-C) is graceful: the process stops accepting at once, ``/healthz``
answers 503 ``draining``, agents' streams are closed with 1012 (service restart: reconnect
now, elsewhere), and requests in flight run on for up to ``LLMGW_SHUTDOWN_GRACE`` seconds.
Then those still running are ended with an OpenAI-shaped error and recorded as interrupted
(``gateway.relay.drain``), the usage rows are stored, and the process exits. A second signal of
the same stop (a terminal's Ctrl-C reaches every process, then ``manage.py run`` sends
SIGTERM) changes nothing; one that comes later forces the exit.

    python -m llmgw_site.webserver --listen client=3 [--listen admin=4 ...] [--app MOD:ATTR]

Slow clients are bounded (``llmgw_site.client_deadlines``): a request's headers must be in
``LLMGW_HEADER_TIMEOUT`` seconds after its connection opened, and its body
``LLMGW_BODY_TIMEOUT`` seconds after its headers; past either, 408 and the connection closes.

``--ready-fd N`` writes one byte to descriptor N once the process accepts: the launcher's
rolling restart waits for it before it stops the process this one replaces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from types import FrameType

import uvicorn

from agents import logs
from gateway.relay.drain import drain
from llmgw_site import client_deadlines
from llmgw_site.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_IDLE_LINGER,
    DEFAULT_SHUTDOWN_GRACE,
    env_bool,
    env_choice,
    env_float,
)
from llmgw_site.diagnostics import process as diagnostics
from llmgw_site.listeners import ROLE_NAMES, listeners_value

logger = logging.getLogger("llmgw.webserver")

# What a stop gives uvicorn beyond our own cut, so that it cancels only what the cut missed.
CUT_MARGIN_SECONDS = 3.0
# Signals this close together are one stop told twice, not an operator insisting.
SAME_STOP_SECONDS = 2.0
# Longer than a balancer's or client pool's own idle timeout (60 s is common), so that the
# client side closes first and never sends on a connection the server is closing.
KEEP_ALIVE_SECONDS = 75
# A WebSocket frame past this is refused by the server before the application buffers it
# (1009); the agents' protocol itself allows 512 KiB (agents.protocol.vocabulary.MAX_MESSAGE_BYTES).
WS_MAX_BYTES = 1024 * 1024


class WebServer(uvicorn.Server):
    """uvicorn with llmgw's stop: drain, cut at the grace, a readiness byte at start."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        grace: float,
        ready_fd: int | None,
        idle_linger: float = DEFAULT_IDLE_LINGER,
    ) -> None:
        super().__init__(config)
        self.grace = grace
        self.idle_linger = idle_linger
        self.ready_fd = ready_fd
        self.first_signal_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
            self._begin_drain()
        elif now - self.first_signal_at > SAME_STOP_SECONDS:
            self.force_exit = True
        self.should_exit = True

    def _begin_drain(self) -> None:
        drain.begin()
        loop = asyncio.get_event_loop()
        # The handler runs between the loop's callbacks; schedule through the loop's own queue.
        loop.call_soon_threadsafe(loop.call_later, self.grace, self._cut)

    def _cut(self) -> None:
        count = drain.cut_remaining()
        if count:
            logger.warning(
                "shutdown grace of %.0fs is over: ending %d request(s) still in flight",
                self.grace,
                count,
            )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's stop, but kinder to kept-alive connections: uvicorn closes idle ones at
        once, and a client that sends its next request on one in that instant sees a
        connection error. Here an idle connection stays open until it has been idle for
        ``LLMGW_IDLE_LINGER`` seconds; a request that arrives on it meanwhile is served, answered
        with ``Connection: close`` (``llmgw_site.asgi`` adds it while draining), and the
        connection closes after that answer, which no client mistakes for an error.

        A connection whose answer is under way is left to the same rule, not told to close
        when it ends (uvicorn's stop does that): an answer that began before the stop went out
        without ``Connection: close``, so its client takes the connection back into its pool
        and may send on it at the very moment it closes (seen: a rolling restart under load,
        a request failing with a read error as a stream that began before it ended)."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            if not hasattr(connection, "cycle"):
                connection.shutdown()  # a WebSocket: 1012 (service restart) now
        try:
            await asyncio.wait_for(
                self._drain_connections(), timeout=self.config.timeout_graceful_shutdown
            )
        except TimeoutError:
            logger.error("cancelling %d task(s) past the grace", len(self.server_state.tasks))
            for task in self.server_state.tasks:
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _drain_connections(self) -> None:
        loop = asyncio.get_running_loop()
        idle_since: dict[object, float] = {}
        state = self.server_state
        while (state.connections or state.tasks) and not self.force_exit:
            now = loop.time()
            for connection in list(state.connections):
                if not idle(connection):
                    idle_since.pop(connection, None)
                elif now - idle_since.setdefault(connection, now) >= self.idle_linger:
                    connection.shutdown()
            await asyncio.sleep(0.05)
        for server in self.servers:
            await server.wait_closed()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # The application is loaded by now, and with it Django's LOGGING, which may have made
        # uvicorn's access logger propagate again. Settle it here: each connection asks once
        # whether it has handlers, and one that does formats a line for every answer.
        access = logging.getLogger("uvicorn.access")
        access.handlers = []
        access.propagate = self.config.access_log
        if self.config.access_log:
            access.setLevel(logging.INFO)
        await super().startup(sockets)
        # Its stacks, profiles and heap for the admin's diagnostics, answered by a thread.
        diagnostics.start(asyncio.get_running_loop())
        if self.ready_fd is not None and self.started:
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, b"1")
                os.close(self.ready_fd)
            self.ready_fd = None


def idle(connection: object) -> bool:
    """An HTTP connection between requests (a WebSocket is never idle: it is a stream)."""
    if not hasattr(connection, "cycle"):
        return False
    cycle = connection.cycle
    return cycle is None or bool(cycle.response_complete)


def listeners(specs: list[str]) -> dict[int, str]:
    """``role=fd`` pairs from the command line, as {fd: role}."""
    out: dict[int, str] = {}
    for spec in specs:
        role, _, fd = spec.partition("=")
        if role not in ROLE_NAMES or not fd.isdigit():
            raise SystemExit(f"--listen {spec!r}: expected ROLE=FD with ROLE one of {ROLE_NAMES}")
        out[int(fd)] = role
    return out


def build_config(
    app: str,
    *,
    access_log: bool,
    grace: float,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        loop="uvloop",
        # httptools, with deadlines on each request's headers and body (slow clients).
        http=client_deadlines.protocol(header_timeout, body_timeout),
        ws="websockets-sansio",
        ws_max_size=WS_MAX_BYTES,
        # The agents' frames are small JSON on a private network: compressing each one costs
        # CPU on both ends and saves nothing (docs/decisions.md, 'no compression on agent
        # WebSockets').
        ws_per_message_deflate=False,
        lifespan="on",
        access_log=access_log,
        log_config=None,  # Django's LOGGING (or the root logger) decides, as for every process
        server_header=False,
        date_header=True,
        proxy_headers=False,  # a balancer's X-Forwarded-For is not trusted by default
        timeout_graceful_shutdown=int(grace + CUT_MARGIN_SECONDS),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", action="append", default=[], metavar="ROLE=FD")
    parser.add_argument("--app", default="llmgw_site.asgi:application")
    parser.add_argument("--ready-fd", type=int, default=None)
    parser.add_argument("--access-log", action="store_true")
    args = parser.parse_args(argv)
    roles = listeners(args.listen)
    if not roles:
        parser.error("at least one --listen ROLE=FD")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    # The application tells the listeners apart by the local address and port of each
    # connection, which uvicorn reads from the accepted socket (scope["server"]).
    sockets = [socket.socket(fileno=fd) for fd in roles]
    bound = {
        sock.getsockname()[:2]: role for sock, role in zip(sockets, roles.values(), strict=True)
    }
    os.environ["LLMGW_LISTENERS"] = listeners_value(bound)
    grace = env_float(os.environ, "LLMGW_SHUTDOWN_GRACE", DEFAULT_SHUTDOWN_GRACE)
    idle_linger = env_float(os.environ, "LLMGW_IDLE_LINGER", DEFAULT_IDLE_LINGER)
    access_log = args.access_log or env_bool(os.environ, "LLMGW_ACCESS_LOG", False)
    if not logging.getLogger().handlers:  # until the application's LOGGING takes over
        log_format = env_choice(os.environ, "LLMGW_LOG_FORMAT", "plain", logs.FORMATS)
        logs.configure(log_format, logging.WARNING, fields={"process": "web"})
    # SIGHUP is for the launcher (a rolling restart); a web process it reaches by accident
    # (a closed terminal) keeps serving until it is told to stop.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    config = build_config(
        args.app,
        access_log=access_log,
        grace=grace,
        header_timeout=env_float(
            os.environ, "LLMGW_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT, minimum=0.1
        ),
        body_timeout=env_float(os.environ, "LLMGW_BODY_TIMEOUT", DEFAULT_BODY_TIMEOUT, minimum=0.1),
    )
    server = WebServer(config, grace=grace, ready_fd=args.ready_fd, idle_linger=idle_linger)
    server.run(sockets=sockets)


if __name__ == "__main__":
    main()
