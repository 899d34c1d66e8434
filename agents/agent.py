"""The agent's side of the stream: dial out, say hello, report, and apply desired state.

The agent dials out (a node behind NAT needs no inbound port), tries each control-plane URL in
turn, and backs off exponentially with jitter between failures so a fleet does not reconnect
in lock-step after a control-plane restart. Losing the control plane never stops a shard: the
supervisor keeps running what it was last told, and reports it all on the next connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from agents import __version__, grpc_wire, links
from agents.protocol.codec import decode_server_message, encode
from agents.protocol.messages import DesiredState, ErrorMessage, Heartbeat, Hello, Welcome
from agents.protocol.vocabulary import MAX_MESSAGE_BYTES, NODE_HEADER, CloseCode, ProtocolError
from agents.supervisor import Supervisor

logger = logging.getLogger(__name__)

# A full status rides along every few heartbeats, so engine load and GPU memory stay fresh
# even when no shard changes state.
FULL_STATUS_EVERY: Final = 5


def stream_url(url: str) -> str:
    """Accept the control plane's web address (``http://cp:8000``) or a full stream URL."""
    return links.parse_target(url, links.WEBSOCKET, insecure=True).url


# The step stops doubling here: 2**30 times the base is past any cap an agent is given.
AT_THE_CAP: Final = 30


def backoff_delay(
    failures: int, *, base: float, cap: float, rand: Callable[[], float] = random.random
) -> float:
    """Capped exponential backoff with "equal jitter": half the step is fixed, half random,
    so retries spread out but never hammer at zero delay."""
    step = min(cap, base * 2.0 ** min(failures, AT_THE_CAP))
    return step / 2 + rand() * step / 2


# A close that says "slow down": more messages than a stream may send, or more streams of this
# node than the control plane takes in its window (4429). The next try waits the backoff's
# cap (with its jitter), not its first short steps: each early try would only add to the
# node's count and keep it refused.
SLOW_DOWN_CLOSE_CODES = frozenset({CloseCode.RATE_LIMITED})


def told_to_slow_down(close_code: int | None) -> bool:
    return close_code in SLOW_DOWN_CLOSE_CODES


# A close that says "this process is stopping", not "something is wrong": reconnect at once
# (another web process or control plane takes the stream), with only a little jitter so a
# fleet does not arrive in the same millisecond.
STOPPING_CLOSE_CODES = frozenset({CloseCode.GOING_AWAY, CloseCode.SERVICE_RESTART})
STOPPING_JITTER_SECONDS = 0.25


def after_stopping_close(close_code: int | None) -> bool:
    """The control plane ended the stream because it is stopping, not because of us."""
    return close_code in STOPPING_CLOSE_CODES


@dataclass(frozen=True)
class ConnectionConfig:
    urls: tuple[str, ...]
    token: str
    node: str
    # Read again before each connection attempt, so a re-issued token written to the token
    # file takes effect without restarting the agent (and its shards).
    token_file: Path | None = None
    addresses: tuple[str, ...] = ()
    port_range: tuple[int, int] | None = None
    backoff_base: float = 0.5
    backoff_max: float = 5.0
    open_timeout: float = 10.0
    hello_timeout: float = 10.0
    # WebSocket pings (gRPC keepalives) find a half-open connection to the control plane
    # (no FIN, no RST).
    ping_interval: float = 10.0
    ping_timeout: float = 10.0
    transport: str = links.WEBSOCKET
    tls: links.TlsFiles = field(default_factory=links.TlsFiles)
    insecure: bool = False


class Agent:
    """One node's link to the control plane, feeding a :class:`Supervisor`."""

    def __init__(
        self,
        config: ConnectionConfig,
        supervisor: Supervisor,
        *,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self.supervisor = supervisor
        self.rand = rand
        self.boot_id = uuid.uuid4().hex
        self.connections = 0
        self.last_close_code: int | None = None  # how the control plane ended the last stream
        self._link: links.Link | None = None
        self.targets = tuple(
            links.parse_target(url, config.transport, insecure=config.insecure)
            for url in config.urls
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Stay connected to some control plane until ``stop`` is set."""
        failures = 0
        index = 0
        while not stop.is_set():
            target = self.targets[index % len(self.targets)]
            url = target.url
            welcomed = False
            self.last_close_code = None
            try:
                welcomed = await self._connect(target, stop)
            except InvalidStatus as exc:
                status = exc.response.status_code
                # A control plane that says why (node tokens not accepted there) is quoted;
                # a refused credential is never told why.
                why = (exc.response.body or b"").decode(errors="replace").strip()[:300]
                if status in (401, 403) and why:
                    logger.error("%s refused this agent (HTTP %s): %s", url, status, why)
                elif status in (401, 403):
                    self._log_refused(url, f"HTTP {status}")
                else:
                    logger.warning("%s answered the handshake with HTTP %s", url, status)
            except links.Refused as exc:
                self._log_refused(url, str(exc))
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI, links.Unreachable) as exc:
                logger.warning("cannot reach %s: %s", url, exc or type(exc).__name__)
            except (ConnectionClosed, links.LinkClosed) as exc:
                logger.warning("connection to %s lost: %s", url, exc)
                if self.last_close_code is None:  # (closed before hello was answered)
                    self.last_close_code = (
                        exc.code
                        if isinstance(exc, links.LinkClosed)
                        else (exc.rcvd.code if exc.rcvd else None)
                    )
            if stop.is_set():
                break
            slow_down = told_to_slow_down(self.last_close_code)
            if welcomed and after_stopping_close(self.last_close_code):
                failures = 0
                index += 1  # that control plane is going away: the next one, now
                delay = self.rand() * STOPPING_JITTER_SECONDS
            else:
                if welcomed and not slow_down:
                    failures = 0  # it worked until now; start over gently, on the same URL
                else:
                    failures += 1
                    index += 1  # try the next control plane
                delay = backoff_delay(
                    AT_THE_CAP if slow_down else failures,
                    base=self.config.backoff_base,
                    cap=self.config.backoff_max,
                    rand=self.rand,
                )
            logger.info(
                "reconnecting in %.1fs to %s",
                delay,
                self.targets[index % len(self.targets)].url,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    def _log_refused(self, url: str, why: str) -> None:
        logger.error(
            "%s refused this agent (%s): the node token or certificate is missing, wrong or "
            "revoked, or was issued for another node than %r",
            url,
            why,
            self.config.node,
        )

    async def report_now(self) -> None:
        """Send a full status at once if connected (the last word before shutting down)."""
        link = self._link
        if link is None:
            return
        with contextlib.suppress(ConnectionClosed, links.LinkClosed, OSError, TimeoutError):
            await asyncio.wait_for(link.send(encode(self.supervisor.status())), timeout=2)

    def _token(self) -> str:
        path = self.config.token_file
        if path is None:
            return self.config.token
        try:
            token = path.read_text().strip()
        except OSError as exc:
            logger.warning("cannot read %s (%s); using the token read before", path, exc)
            return self.config.token
        return token or self.config.token

    @contextlib.asynccontextmanager
    async def _open(self, target: links.Target) -> AsyncIterator[links.Link]:
        token = self._token()
        if target.transport == links.GRPC:
            metadata = [(grpc_wire.NODE_KEY, self.config.node)]
            if token:
                metadata.append(("authorization", f"Bearer {token}"))
            link = await links.open_grpc(
                target,
                self.config.tls,
                tuple(metadata),
                open_timeout=self.config.open_timeout,
                keepalive_s=self.config.ping_interval,
                max_message_bytes=MAX_MESSAGE_BYTES,
                write_timeout=self.config.ping_timeout,
            )
            try:
                yield link
            finally:
                await link.close(1000, "")
            return
        headers = {NODE_HEADER: self.config.node}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        ssl_context = _websocket_tls(self.config.tls) if target.tls else None
        async with connect(
            target.url,
            additional_headers=headers,
            user_agent_header=f"llmgw-agent/{__version__}",
            open_timeout=self.config.open_timeout,
            ping_interval=self.config.ping_interval,
            ping_timeout=self.config.ping_timeout,
            close_timeout=2,
            max_size=MAX_MESSAGE_BYTES,
            proxy=None,
            ssl=ssl_context,
        ) as ws:
            yield links.WebSocketLink(ws)

    async def _connect(self, target: links.Target, stop: asyncio.Event) -> bool:
        url = target.url
        async with self._open(target) as link:
            welcome = await self._handshake(link)
            if welcome is None:
                return False
            self.connections += 1
            self._link = link
            logger.info(
                "connected to %s as node %s over %s (heartbeat every %gs)",
                url,
                self.config.node,
                target.transport,
                welcome.heartbeat_interval,
            )
            # Everything this node runs, at once: the control plane may have restarted, or
            # another one may hold this stream now; shards kept running meanwhile.
            await link.send(encode(self.supervisor.status()))
            tasks = {
                asyncio.create_task(self._receive(link), name="receive"),
                asyncio.create_task(self._report(link, welcome.heartbeat_interval), name="report"),
                asyncio.create_task(stop.wait(), name="stop"),
            }
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._link = None
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if stop.is_set():
                await link.close(1001, "agent shutting down")
                return True
            for task in done:
                exc = task.exception()
                if exc is not None and not isinstance(exc, ConnectionClosed | links.LinkClosed):
                    raise exc
            self.last_close_code = link.close_code
            if link.close_code in (None, 1006):
                logger.warning("stream to %s lost (no close code)", url)
            else:
                logger.warning(
                    "control plane %s closed the stream (code %s%s)",
                    url,
                    link.close_code,
                    f": {link.close_reason}" if link.close_reason else "",
                )
            return True

    async def _handshake(self, link: links.Link) -> Welcome | None:
        local = link.local_address()
        hello = Hello(
            node=self.config.node,
            boot_id=self.boot_id,
            agent_version=__version__,
            gpus=self.supervisor.gpus.read(),
            addresses=self.config.addresses or ((local,) if local else ()),
            port_range=self.config.port_range,
            highest_epoch=self.supervisor.highest_epoch,
        )
        await link.send(encode(hello))
        raw = await asyncio.wait_for(link.recv(), timeout=self.config.hello_timeout)
        try:
            answer = decode_server_message(raw)
        except ProtocolError as exc:
            logger.error("the control plane's answer to hello is not understood: %s", exc)
            await link.close(int(exc.code), exc.message[:120])
            return None
        if isinstance(answer, ErrorMessage):
            logger.error("the control plane refused hello: %s (%s)", answer.message, answer.code)
            self.last_close_code = answer.code
            return None
        if not isinstance(answer, Welcome):
            logger.error("the control plane answered hello with %s, not welcome", type(answer))
            return None
        return answer

    async def _receive(self, link: links.Link) -> None:
        while True:
            raw = await link.recv()
            try:
                message = decode_server_message(raw)
            except ProtocolError as exc:
                # A bad snapshot must not take the node down or loop reconnecting: say so,
                # keep running what runs, and wait for the next one.
                logger.error("ignoring a message from the control plane: %s", exc.message)
                await link.send(encode(ErrorMessage(int(exc.code), exc.message)))
                continue
            if isinstance(message, DesiredState):
                if message.node != self.config.node:
                    logger.error(
                        "ignoring desired state for node %r: this is %r",
                        message.node,
                        self.config.node,
                    )
                    continue
                self.supervisor.apply(message)
            elif isinstance(message, ErrorMessage):
                logger.warning(
                    "control plane error %s: %s", message.code, message.message or "(no text)"
                )
                if message.code == CloseCode.SERVICE_RESTART:
                    # It is going away: leave now rather than wait for it to end the stream,
                    # which a control plane stuck in its stop may never do.
                    await link.close(message.code, message.message)
                    return

    async def _report(self, link: links.Link, interval: float) -> None:
        changed = self.supervisor.changed
        seq = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=interval)
            seq += 1
            if changed.is_set() or seq % FULL_STATUS_EVERY == 0:
                changed.clear()
                await link.send(encode(self.supervisor.status()))
            else:
                await link.send(encode(Heartbeat(seq=seq)))


def _websocket_tls(tls: links.TlsFiles) -> ssl.SSLContext:
    """``wss://``: the system's trust store, or the cluster CA when one is given (a client
    certificate too, for a proxy in front that checks it)."""
    context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(str(tls.cert), str(tls.key))
    return context
