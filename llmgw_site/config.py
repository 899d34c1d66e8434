"""Reading llmgw's configuration from the environment.

Every knob is an environment variable (12-factor). A malformed value stops start-up with a
message that names the variable, so an operator never has to guess which setting was wrong.
Pure functions over a mapping: tests pass a dict instead of touching ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

# How long a stopping web process lets requests in flight finish (LLMGW_SHUTDOWN_GRACE).
DEFAULT_SHUTDOWN_GRACE = 30.0
# How long a stopping web process keeps an idle kept-alive connection open (LLMGW_IDLE_LINGER):
# longer than the common clients' own idle expiry (httpx, and so the openai client: 5 s) plus
# how far behind a busy client reads, so that the client drops the connection first and never
# sends a request into the server's close. The server counts idle from the moment it wrote an
# answer's end; the client counts its 5 s from the moment it read it, and a client starved of
# CPU reads seconds later (shorter lingers were measured too short: docs/decisions.md, 'idle
# kept-alive connections at a stop'). Behind a balancer whose idle timeout is known, it can be
# shorter.
DEFAULT_IDLE_LINGER = 20.0

# A request's headers must be in this long after its connection opened (after its first byte on
# a kept-alive connection), and its body this long after its headers (LLMGW_HEADER_TIMEOUT,
# LLMGW_BODY_TIMEOUT; llmgw_site.client_deadlines). Headers come in one packet from any client;
# a minute is 8 MiB (the default body limit) at about 1 Mbit/s.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0

# channels_redis waits for a group message in a blocking pop of 5 s at a time
# (RedisChannelLayer.brpop_timeout). redis-py 8 gives every read a 5 s timeout by default, so
# each quiet wait ended in a TimeoutError: streams fell back to resyncs, and nudges were lost.
# Longer than the pop, and still finite, so that a connection dropped without a FIN is noticed.
CHANNEL_LAYER_READ_TIMEOUT_S = 30.0


# The Redis clients that keep counters (the gateway's limits and counts, the agents' stream
# counts) give up on a Redis that does not answer within a timeout each caller names: redis-py
# 8 waits 5 s for a connection or a read by default, and retries a call ten times. Nor is a
# failed call retried here: one whose answer was lost may have counted already; a pooled
# connection that a restarted Redis dropped is replaced before use (by redis-py's pool for a
# synchronous client; for the request path's asyncio one, by gateway.identity.counters).


def counter_redis_options(timeout: float, *, for_asyncio: bool = False) -> dict[str, Any]:
    """Timeouts and retries for a counters' Redis client (``redis.Redis.from_url(url, **...)``,
    or ``redis.asyncio`` with ``for_asyncio``): a call not answered within ``timeout`` seconds
    fails, and none is retried."""
    from redis.backoff import NoBackoff  # noqa: PLC0415 - only processes that use Redis pay

    if for_asyncio:
        from redis.asyncio.retry import Retry as AsyncRetry  # noqa: PLC0415

        retry: object = AsyncRetry(NoBackoff(), 0)
    else:
        from redis.retry import Retry  # noqa: PLC0415

        retry = Retry(NoBackoff(), 0)
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": retry}


def redis_channel_layer(url: str) -> dict[str, object]:
    """The channel layer on the Redis at ``url``, its reads outlasting the layer's own waits."""
    host = {"address": url, "socket_timeout": CHANNEL_LAYER_READ_TIMEOUT_S}
    return {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [host]}}


def process_name(argv: Sequence[str]) -> str:
    """What this process is, from its command line, for its log lines and its diagnostics:
    ``web`` (``python -m llmgw_site.webserver``), ``worker`` or ``beat`` (Celery), a
    ``manage.py`` command's name, else the program's own."""
    program = PurePath(argv[0]) if argv else PurePath("python")
    if program.name == "webserver.py" and program.parent.name == "llmgw_site":
        return "web"
    if program.name == "celery" or (program.parent.name == "celery" and program.stem == "__main__"):
        return next((word for word in argv[1:] if word in ("worker", "beat")), "celery")
    if program.name == "manage.py" and len(argv) > 1:
        return argv[1]
    return program.stem


class ConfigError(Exception):
    """A configuration value could not be used; the message names the variable."""


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name)
    return default if value is None or value == "" else value


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def env_choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of a few words (``choices``), as written, else an error that lists them."""
    value = env_str(env, name, default).strip()
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def env_list(env: Mapping[str, str], name: str, default: list[str]) -> list[str]:
    """A comma-separated list; blanks around items are dropped."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not value >= minimum:  # also rejects NaN
        raise ConfigError(f"{name}={raw!r} must be at least {minimum:g}")
    return value


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


def env_port_range(env: Mapping[str, str], name: str, default: tuple[int, int]) -> tuple[int, int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    low_text, sep, high_text = raw.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a port range like 20000-20999") from None
    if not sep or not 1 <= low <= high <= 65535:
        raise ConfigError(f"{name}={raw!r} is not a port range like 20000-20999")
    return low, high


@dataclass(frozen=True)
class StaticEndpoint:
    """An upstream given at start for router-only runs: ``id=URL=model[,model]``."""

    id: str
    url: str
    models: tuple[str, ...]


def parse_static_endpoints(env: Mapping[str, str], name: str) -> tuple[StaticEndpoint, ...]:
    """Parse ``id=URL=model[,model]`` entries separated by spaces or semicolons."""
    raw = env.get(name, "")
    endpoints: list[StaticEndpoint] = []
    seen: set[str] = set()
    for entry in raw.replace(";", " ").split():
        parts = entry.split("=", 2)
        if len(parts) != 3 or not all(parts):
            raise ConfigError(f"{name}: {entry!r} is not of the form id=URL=model[,model]")
        endpoint_id, url, models_text = parts
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{name}: {entry!r} needs an http:// or https:// URL")
        models = tuple(m for m in models_text.split(",") if m)
        if not models:
            raise ConfigError(f"{name}: {entry!r} names no model")
        if endpoint_id in seen:
            raise ConfigError(f"{name}: endpoint id {endpoint_id!r} appears twice")
        seen.add(endpoint_id)
        endpoints.append(StaticEndpoint(endpoint_id, url.rstrip("/"), models))
    return tuple(endpoints)


def static_endpoints_with_flags(
    env: Mapping[str, str], name: str, flag: str, values: Iterable[str]
) -> tuple[StaticEndpoint, ...]:
    """The endpoints of the variable ``name`` and of each ``flag`` value together: they add up
    (the variable's first), and an id given twice, in either or across both, is refused naming
    where each came from. A flag value has the variable's format."""
    endpoints = list(parse_static_endpoints(env, name))
    origin = dict.fromkeys((e.id for e in endpoints), name)
    for value in values:
        for endpoint in parse_static_endpoints({flag: value}, flag):
            if endpoint.id in origin:
                also = "" if origin[endpoint.id] == flag else f" (it is in {name} too)"
                raise ConfigError(f"{flag}: endpoint id {endpoint.id!r} appears twice{also}")
            origin[endpoint.id] = flag
            endpoints.append(endpoint)
    return tuple(endpoints)


def static_endpoints_text(endpoints: Iterable[StaticEndpoint]) -> str:
    """``endpoints`` written back in the variable's format (:func:`parse_static_endpoints`
    reads it back to the same)."""
    return " ".join(f"{e.id}={e.url}={','.join(e.models)}" for e in endpoints)
