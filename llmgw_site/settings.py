"""The one settings module. Everything that differs between machines comes from the environment.

The embedded default (nothing set) is SQLite under ``var/``, an in-process channel layer and a
local filesystem broker, so ``make run`` needs nothing but Python. Production sets
``DATABASE_URL`` (PostgreSQL) and ``REDIS_URL``; the code is the same.

Longer than 600 lines and still one idea: what the environment says, each setting read,
bounded and explained where it is defined, and every setting's error gathered into one message
at start-up. Split, an operator looking for a variable would have to know which file holds it.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from llmgw_site import owner_only
from llmgw_site.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_IDLE_LINGER,
    DEFAULT_SHUTDOWN_GRACE,
    ConfigError,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_port_range,
    env_str,
    parse_static_endpoints,
    process_name,
    redis_channel_layer,
)

# Generic admin and queryset classes (ModelAdmin[Node]) must be subscriptable at run time.
django_stubs_ext.monkeypatch()

# Before anything is created: the store, the secret key, the CA and the journals are this
# user's alone, whatever the umask of the shell that started the process (llmgw_site.owner_only).
owner_only.restrict_umask()

ENV = os.environ
BASE_DIR = Path(__file__).resolve().parent.parent
# templates/ and static/ sit at the top of a checkout; the llmgw wheel carries them inside this
# package, in share/ (pyproject.toml), so an installed llmgw finds them from any directory.
_PACKAGED_FILES = Path(__file__).resolve().parent / "share"
_INSTALLED = _PACKAGED_FILES.is_dir()
SITE_FILES_DIR = _PACKAGED_FILES if _INSTALLED else BASE_DIR
# The store, the secret material and the journals: var/ in a checkout (where `make run` keeps
# them); for an installed llmgw, this user's data folder (XDG_DATA_HOME), one store whatever
# directory `llmgw run` or `llmgw migrate` is started from. LLMGW_VAR_DIR says elsewhere.
if env_str(ENV, "LLMGW_VAR_DIR", ""):
    VAR_DIR = Path(ENV["LLMGW_VAR_DIR"])
elif _INSTALLED:
    VAR_DIR = Path(env_str(ENV, "XDG_DATA_HOME", "") or Path.home() / ".local/share") / "llmgw"
else:
    VAR_DIR = BASE_DIR / "var"
VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)

LLMGW_VERSION = "0.1.0"

_errors: list[str] = []


def _read(read: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one env reader, collecting its error so start-up reports every bad variable at once."""
    try:
        return read(ENV, *args, **kwargs)
    except ConfigError as exc:
        _errors.append(str(exc))
        return args[1] if len(args) > 1 else None


DEBUG: bool = _read(env_bool, "LLMGW_DEBUG", False)
SECRET_KEY = ENV.get("SECRET_KEY", "")
if not SECRET_KEY:
    if DEBUG:
        SECRET_KEY = "llmgw-insecure-debug-only-key"  # noqa: S105 - DEBUG only, never served
    else:
        _errors.append("SECRET_KEY is required when LLMGW_DEBUG is off")

# --- who may reach this site, and how (secure by default when DEBUG is off) -------------------
# Host names this deployment answers to. Unset with DEBUG off: loopback only, so a production
# deployment must name its hosts (a wildcard would let any Host header through, and with it
# poisoned password-reset and redirect links).
ALLOWED_HOSTS = _read(
    env_list, "LLMGW_ALLOWED_HOSTS", ["*"] if DEBUG else ["127.0.0.1", "localhost", "[::1]"]
)
CSRF_TRUSTED_ORIGINS = _read(env_list, "LLMGW_CSRF_TRUSTED_ORIGINS", [])
for _origin in CSRF_TRUSTED_ORIGINS:
    if not _origin.startswith(("http://", "https://")):
        _errors.append(
            f"LLMGW_CSRF_TRUSTED_ORIGINS: {_origin!r} needs its scheme, e.g. https://{_origin}"
        )
# Behind a TLS-terminating proxy: the header it sets to say the client used https, e.g.
# "X-Forwarded-Proto" (then "https" means secure). Trust it only when the proxy always sets or
# strips it: a client could otherwise claim https itself.
_proxy_header = env_str(ENV, "LLMGW_PROXY_TLS_HEADER", "")
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _proxy_header.upper().replace("-", "_"), "https") if _proxy_header else None
)
# Served over https (directly or behind that proxy): cookies only over TLS, plain http
# redirected, and HSTS. On by default when DEBUG is off; `make run` (loopback, plain http)
# turns it off with LLMGW_HTTPS=false.
LLMGW_HTTPS: bool = _read(env_bool, "LLMGW_HTTPS", not DEBUG)
SESSION_COOKIE_SECURE = LLMGW_HTTPS
CSRF_COOKIE_SECURE = LLMGW_HTTPS
# Redirecting plain http to https is usually the proxy's job, and internal callers (health
# checks, metrics scrapers, agents on a private network) may speak plain http: on request.
SECURE_SSL_REDIRECT: bool = _read(env_bool, "LLMGW_SSL_REDIRECT", False)
# Health checks and metrics come from inside the network, over plain http.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SECURE_HSTS_SECONDS: int = _read(env_int, "LLMGW_HSTS_SECONDS", 31_536_000) if LLMGW_HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = _read(env_bool, "LLMGW_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = _read(env_bool, "LLMGW_HSTS_PRELOAD", False)
# Preloading binds the whole domain and its subdomains to https in every browser, and takes
# months to undo: the domain's owner decides (LLMGW_HSTS_PRELOAD), so its absence is no warning.
SILENCED_SYSTEM_CHECKS = [] if SECURE_HSTS_PRELOAD else ["security.W021"]
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE: int = _read(env_int, "LLMGW_SESSION_SECONDS", 12 * 3600, minimum=60)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

# Daphne's app does one thing: `runserver` (development) becomes its ASGI server, so the agents'
# WebSockets work there too. Installed for that command only: it imports Twisted at start, and
# every other process (the uvicorn web processes, the worker, beat, each command) would pay
# CPU and memory for it (docs/decisions.md, 'daphne only for runserver').
DEVELOPMENT_SERVER = sys.argv[1:2] == ["runserver"]

INSTALLED_APPS = [
    *(["daphne"] if DEVELOPMENT_SERVER else []),  # first, so that its `runserver` wins
    # The admin without autodiscovery at start: llmgw_site.urls registers the ModelAdmins when
    # the site's URLconf first loads, so a web process that serves only /v1 never imports them
    # (a shorter start: docs/decisions.md, 'admin registered when the site's URLconf loads').
    "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_prometheus",
    "axes",  # failed sign-ins per account and per address, and the lockouts (admin: "Axes")
    "control",
    "gateway",
    "llmgw_site",  # the commands that span both apps: run, import_catalog, export_catalog
    "llmgw_site.admin_api",  # /api/admin/v1/ and its admin tokens
]

MIDDLEWARE = [
    # First and last, so django-prometheus times everything between (admin, account, metrics);
    # /v1 has its own handler and metrics (telemetry.metrics).
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last before the metrics: answers a locked-out sign-in with 429 (django-axes).
    "axes.middleware.AxesMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "llmgw_site.urls"
ASGI_APPLICATION = "llmgw_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [SITE_FILES_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "llmgw_site.sso.context",
            ],
        },
    },
]

# --- the store -------------------------------------------------------------------------------

DATABASE_URL = env_str(ENV, "DATABASE_URL", f"sqlite:///{VAR_DIR / 'llmgw.sqlite3'}")
try:
    _database: dict[str, Any] = dict(dj_database_url.parse(DATABASE_URL))
except ValueError as exc:
    _errors.append(f"DATABASE_URL is not a usable database URL: {exc}")
    _database = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}

if _database["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets readers run beside the one writer; IMMEDIATE takes the write lock at BEGIN, so a
    # transaction never fails half-way upgrading a read lock ("database is locked" without
    # waiting); the timeout is the busy handler: writers queue instead of failing.
    _database["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": _read(env_float, "LLMGW_SQLITE_BUSY_TIMEOUT", 20.0),
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    _name = Path(str(_database["NAME"]))
    # Tests that start real processes need a file they can share, never ":memory:".
    _database["TEST"] = {"NAME": str(_name.with_name(f"test_{_name.name}"))}
elif _database["ENGINE"] in {
    "django.db.backends.postgresql",
    "django.db.backends.postgresql_psycopg2",
}:
    _database["ENGINE"] = "django.db.backends.postgresql"
    _database["CONN_HEALTH_CHECKS"] = True
    # A store that stops answering must fail calls, not hang them: a leader cut off from the
    # database has to notice within its renew deadline, and a web process must answer 503.
    _database["OPTIONS"] = {
        "connect_timeout": _read(env_int, "LLMGW_DB_CONNECT_TIMEOUT", 5, minimum=1),
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
        **_database.get("OPTIONS", {}),
    }
    # A web process holds hundreds of agent streams, and Django closes a connection after
    # each piece of sync work: without a pool every heartbeat written and every stream opened
    # costs a new server backend (at fleet scale handshakes timed out and nodes went
    # unreachable: docs/decisions.md, 'store connection pool'). The pool keeps a few
    # connections open and bounds them: at most LLMGW_DB_POOL_MAX per process (0: no pool, a
    # connection per unit of work).
    _pool_max = _read(env_int, "LLMGW_DB_POOL_MAX", 5, minimum=0)
    if _pool_max:
        _database["OPTIONS"]["pool"] = {
            "min_size": 0,
            "max_size": _pool_max,
            # Waiting for a free connection longer than a connection attempt may take means
            # the store is down or overloaded: fail the call as a failed connect would.
            "timeout": float(_database["OPTIONS"]["connect_timeout"]),
            "max_idle": 60.0,
            # psycopg-pool retries a failed connection with a doubling delay (attempts 1, 3, 7,
            # 15, 31 s... after the first) until this long has passed, and makes no other
            # meanwhile: at its default (5 minutes) a store that came back was reconnected to
            # as late again as it had been away. Given up sooner, the next call that wants a
            # connection starts a new attempt at once.
            "reconnect_timeout": float(_database["OPTIONS"]["connect_timeout"]),
        }
else:
    _errors.append(f"DATABASE_URL uses {_database['ENGINE']}; llmgw supports sqlite and postgres")

DATABASES = {"default": _database}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: channel layer, broker, shared counters (all optional) ---------------------------------

REDIS_URL = env_str(ENV, "REDIS_URL", "")
if REDIS_URL and not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    _errors.append(f"REDIS_URL={REDIS_URL!r} is not a redis://, rediss:// or unix:// URL")

if REDIS_URL:
    CHANNEL_LAYERS = {"default": redis_channel_layer(REDIS_URL)}
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Celery (the reconciler's beat and worker) --------------------------------------------------

_broker_dir = VAR_DIR / "broker"
if not REDIS_URL:
    for _folder in ("processed", "bindings"):
        (_broker_dir / _folder).mkdir(mode=0o700, parents=True, exist_ok=True)
# Without Redis: kombu's filesystem transport made atomic (llmgw_site.broker), which
# llmgw_site.celery registers under this scheme.
CELERY_BROKER_URL = REDIS_URL or "llmgwfs://localhost/"
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = (
    {}
    if REDIS_URL
    else {
        # A local broker for the embedded default: kombu's filesystem transport shares a folder
        # between the worker and beat on one machine, with no service to install.
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(_broker_dir / "processed"),
        # Exchange bindings; kombu's default is a folder named "control" in the working
        # directory, which here is the control app itself.
        "control_folder": str(_broker_dir / "bindings"),
        "store_processed": False,
        # The reconciler ticks about every second; poll the folder often enough not to lag.
        "polling_interval": 0.1,
    }
)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
# Log through Django's LOGGING, where the per-task lines (one a second) are turned down.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- llmgw's own knobs ------------------------------------------------------------------------

# Every control plane competes for the leadership lease, always: there is always a store, so
# there may always be another control plane on it. Nothing turns that off; a leftover
# "off" is refused rather than ignored, so nobody believes they run without the lease.
if not _read(env_bool, "LLMGW_LEADER_ELECTION", True):
    _errors.append(
        "LLMGW_LEADER_ELECTION cannot be turned off: every control plane competes for the "
        "leadership lease (a single one simply holds it); remove the variable"
    )
LLMGW_LEASE_TTL: float = _read(env_float, "LLMGW_LEASE_TTL", 10.0, minimum=1.0)
# The holder stops acting this long after it *sent* its last confirmed renew, well before the
# row can expire for anybody else (the Kubernetes "renew deadline" idea).
LLMGW_LEASE_RENEW_DEADLINE: float = _read(
    env_float, "LLMGW_LEASE_RENEW_DEADLINE", LLMGW_LEASE_TTL * 2 / 3, minimum=0.1
)
LLMGW_RECONCILE_INTERVAL: float = _read(env_float, "LLMGW_RECONCILE_INTERVAL", 1.0, minimum=0.1)
# How long one tick may last (its snapshot included) before it leaves the remaining models to
# the next tick: a wave of activations is placed over several short ticks, back to back, so
# the leader keeps renewing its lease and noticing failures meanwhile.
LLMGW_RECONCILE_TICK_BUDGET: float = _read(
    env_float, "LLMGW_RECONCILE_TICK_BUDGET", LLMGW_RECONCILE_INTERVAL * 0.15, minimum=0.05
)
LLMGW_BACKOFF_BASE: float = _read(env_float, "LLMGW_BACKOFF_BASE", 2.0, minimum=0.1)
LLMGW_BACKOFF_MAX: float = _read(env_float, "LLMGW_BACKOFF_MAX", 300.0, minimum=0.1)
LLMGW_UNREACHABLE_AFTER: float = _read(env_float, "LLMGW_UNREACHABLE_AFTER", 15.0, minimum=1.0)
LLMGW_LOST_AFTER: float = _read(env_float, "LLMGW_LOST_AFTER", 60.0, minimum=1.0)
LLMGW_PORT_RANGE: tuple[int, int] = _read(env_port_range, "LLMGW_PORT_RANGE", (20000, 20999))
# Agent streams: how often agents beat (sent to them in the welcome), how often a stream
# re-sends the full desired state in case a nudge was lost, and how long a drain may wait
# for in-flight requests before the engine is stopped.
LLMGW_AGENT_HEARTBEAT_INTERVAL: float = _read(
    env_float,
    "LLMGW_AGENT_HEARTBEAT_INTERVAL",
    min(2.0, LLMGW_UNREACHABLE_AFTER / 5),
    minimum=0.05,
)
LLMGW_AGENT_RESYNC_INTERVAL: float = _read(
    env_float, "LLMGW_AGENT_RESYNC_INTERVAL", 15.0, minimum=0.1
)
# Without Redis the channel layer is per process, so a nudge from the reconciler's worker
# cannot reach the web process holding an agent's stream: that process then checks the node's
# desired-state revision in the store this often (one indexed read per agent) instead.
LLMGW_AGENT_REVISION_POLL: float = _read(
    env_float, "LLMGW_AGENT_REVISION_POLL", 0.0 if REDIS_URL else 0.25
)
LLMGW_DRAIN_TIMEOUT: float = _read(env_float, "LLMGW_DRAIN_TIMEOUT", 60.0)
# The gRPC agent listener (``manage.py serve_agents_grpc``; ``manage.py run`` starts it when
# this is set) and its TLS material (``manage.py init_ca`` writes it here).
LLMGW_AGENT_LISTEN: str = env_str(ENV, "LLMGW_AGENT_LISTEN", "")
# A node's identity is a client certificate of that CA, and a node token opens no stream on
# any transport: the gRPC listener admits only certificates (mutual TLS) and WebSocket streams
# are refused at the handshake. ``..._GRPC_REQUIRE_IDENTITY`` asks it of the gRPC listener
# alone, for a fleet whose other nodes keep tokens over WebSocket.
LLMGW_AGENT_REQUIRE_IDENTITY: bool = _read(env_bool, "LLMGW_AGENT_REQUIRE_IDENTITY", False)
LLMGW_AGENT_GRPC_REQUIRE_IDENTITY: bool = _read(
    env_bool, "LLMGW_AGENT_GRPC_REQUIRE_IDENTITY", False
)
LLMGW_CA_DIR = Path(env_str(ENV, "LLMGW_CA_DIR", str(VAR_DIR / "ca")))
# What one node may cost the store: messages a stream may send per second (sustained, and in
# a burst), and Event rows its reports may write per minute.
LLMGW_AGENT_MESSAGES_PER_SECOND: float = _read(
    env_float, "LLMGW_AGENT_MESSAGES_PER_SECOND", 20.0, minimum=0.1
)
LLMGW_AGENT_MESSAGE_BURST: int = _read(env_int, "LLMGW_AGENT_MESSAGE_BURST", 200, minimum=1)
LLMGW_NODE_EVENTS_PER_MINUTE: int = _read(env_int, "LLMGW_NODE_EVENTS_PER_MINUTE", 60, minimum=1)
# Streams one node may open per window, counted across every web process and listener (in
# Redis when REDIS_URL is set, else in the store): each brings a fresh message allowance and
# costs a hello (a registration, a full desired state). A healthy agent opens one per control
# plane restart, one per move of a web process's drain (a rolling restart of N processes moves
# it at most N times), one after a half-open connection: a handful a minute at the very worst,
# where a node reconnecting in a loop at the agent's fastest pace opens over a hundred.
# A node past the limit is refused (4429) until its window ends, at most this long.
LLMGW_AGENT_HELLO_LIMIT: int = _read(env_int, "LLMGW_AGENT_HELLO_LIMIT", 20, minimum=1)
LLMGW_AGENT_HELLO_WINDOW: float = _read(env_float, "LLMGW_AGENT_HELLO_WINDOW", 60.0, minimum=1.0)
# Relay deadlines (seconds); models may override each.
LLMGW_CONNECT_TIMEOUT: float = _read(env_float, "LLMGW_CONNECT_TIMEOUT", 5.0, minimum=0.01)
LLMGW_FIRST_BYTE_TIMEOUT: float = _read(env_float, "LLMGW_FIRST_BYTE_TIMEOUT", 120.0, minimum=0.01)
LLMGW_STREAM_IDLE_TIMEOUT: float = _read(env_float, "LLMGW_STREAM_IDLE_TIMEOUT", 60.0, minimum=0.01)
LLMGW_ACCESS_LOG: bool = _read(env_bool, "LLMGW_ACCESS_LOG", False)
# A stopping web process lets requests and streams in flight run this long, then ends them.
LLMGW_SHUTDOWN_GRACE: float = _read(env_float, "LLMGW_SHUTDOWN_GRACE", DEFAULT_SHUTDOWN_GRACE)
# ...and keeps an idle kept-alive connection open this long, so the client closes it first
# (read by the web process itself; here so that a bad value stops `manage.py run` at once).
LLMGW_IDLE_LINGER: float = _read(env_float, "LLMGW_IDLE_LINGER", DEFAULT_IDLE_LINGER)
# A request's headers and its body must arrive within these (seconds), else 408 and the
# connection is closed (read by the web process itself, llmgw_site.client_deadlines).
LLMGW_HEADER_TIMEOUT: float = _read(
    env_float, "LLMGW_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT, minimum=0.1
)
LLMGW_BODY_TIMEOUT: float = _read(
    env_float, "LLMGW_BODY_TIMEOUT", DEFAULT_BODY_TIMEOUT, minimum=0.1
)
LLMGW_STATIC_ENDPOINTS = _read(parse_static_endpoints, "LLMGW_STATIC_ENDPOINTS") or ()
# Every process answers diagnostic requests (stacks, profiles, heap) on a socket of its own
# under VAR_DIR/diagnostics (llmgw_site.diagnostics); off, none does, and nothing of it runs.
LLMGW_DIAGNOSTICS: bool = _read(env_bool, "LLMGW_DIAGNOSTICS", True)
# What this process is (web, worker, beat, a command's name): in its log lines and diagnostics.
LLMGW_PROCESS = process_name(sys.argv)

# --- the gateway (/v1) --------------------------------------------------------------------------
# Larger bodies are refused with 413 as soon as their length is known, before they are buffered.
LLMGW_MAX_BODY_BYTES: int = _read(env_int, "LLMGW_MAX_BODY_BYTES", 8 * 1024 * 1024, minimum=1024)
# A cap on top-level `messages`/`input` items: 400 naming the field, whatever the byte size.
LLMGW_MAX_ITEMS: int = _read(env_int, "LLMGW_MAX_ITEMS", 10_000, minimum=1)
# How long a key lookup is trusted in-process: revocation is visible to every process within it.
LLMGW_KEY_CACHE_TTL: float = _read(env_float, "LLMGW_KEY_CACHE_TTL", 5.0)
# How long a request waits for one call to the store (a key not cached, limit counters in the
# store, a cold model's waiters) before it is answered 503 and the store taken for unreachable;
# while it is, such calls are refused at once (gateway.dbthread).
LLMGW_STORE_WAIT: float = _read(env_float, "LLMGW_STORE_WAIT", 3.0, minimum=0.1)
# The routing table is reloaded this often (faster while requests wait for a cold model).
LLMGW_ROUTING_REFRESH: float = _read(env_float, "LLMGW_ROUTING_REFRESH", 1.0, minimum=0.05)
# Routing by the cache (gateway.routing.choice): "cache_aware" sends a request where its prompt's
# prefix is cached, bounded by load; "least_outstanding" by load alone.
LLMGW_ROUTING_POLICY: str = _read(
    env_choice, "LLMGW_ROUTING_POLICY", "cache_aware", ("cache_aware", "least_outstanding")
)
# A prompt is keyed in blocks that grow from 256 bytes to this many (about 256 tokens of text),
# at most this many blocks (gateway.routing.prefix).
LLMGW_ROUTING_BLOCK_BYTES: int = _read(env_int, "LLMGW_ROUTING_BLOCK_BYTES", 1024, minimum=64)
LLMGW_ROUTING_MAX_BLOCKS: int = _read(env_int, "LLMGW_ROUTING_MAX_BLOCKS", 512, minimum=1)
# An upstream keeps a cached prefix's or a session's requests while its outstanding requests
# are under factor x the mean or under the slack (this host's count); a prefix hotter
# than one upstream's share of the traffic is bounded by the mean alone.
LLMGW_ROUTING_LOAD_FACTOR: float = _read(env_float, "LLMGW_ROUTING_LOAD_FACTOR", 1.25, minimum=1.0)
LLMGW_ROUTING_LOAD_SLACK: int = _read(env_int, "LLMGW_ROUTING_LOAD_SLACK", 32, minimum=1)
# A prefix nobody holds goes to the first upstream in its agreed (rendezvous) order among those
# where its first token would come soonest and with at most this many more outstanding
# requests than the least loaded of them.
LLMGW_ROUTING_COLD_SLACK: int = _read(env_int, "LLMGW_ROUTING_COLD_SLACK", 1, minimum=0)
# The web processes of one host share their loads and new prefixes' homes (gateway.routing.board)
# and tell each other where they routed each prompt (gateway.routing.peers), so a burst through
# them places each prefix once and a conversation's next turn finds its history whichever takes
# it.
LLMGW_ROUTING_SHARE: bool = _read(env_bool, "LLMGW_ROUTING_SHARE", True)
# Bytes of prompt remembered per upstream whose cache size is not known (engines that report
# theirs are remembered up to it): 8 MiB of prompt text is about two million tokens.
LLMGW_ROUTING_MIRROR_BYTES: int = _read(
    env_int, "LLMGW_ROUTING_MIRROR_BYTES", 8 * 1024 * 1024, minimum=32 * 1024
)
# An upstream that failed (connect error, 5xx before the first byte) gets no traffic this long.
LLMGW_EJECT_SECONDS: float = _read(env_float, "LLMGW_EJECT_SECONDS", 10.0)
# Further attempts before the first byte, on another upstream where there is one.
LLMGW_RETRIES: int = _read(env_int, "LLMGW_RETRIES", 2)
# The longest upstream Retry-After the gateway waits out itself before answering 429/503.
LLMGW_RETRY_AFTER_MAX: float = _read(env_float, "LLMGW_RETRY_AFTER_MAX", 2.0)
# Tokens reserved against tpm/budget limits when a request names no max_tokens.
LLMGW_DEFAULT_MAX_TOKENS: int = _read(env_int, "LLMGW_DEFAULT_MAX_TOKENS", 1024, minimum=1)
# Usage rows are written in batches this often, off the request path.
LLMGW_USAGE_FLUSH_INTERVAL: float = _read(
    env_float, "LLMGW_USAGE_FLUSH_INTERVAL", 0.5, minimum=0.01
)
# Off only to price usage accounting in the benchmark: requests then leave no usage rows.
LLMGW_USAGE_ACCOUNTING: bool = _read(env_bool, "LLMGW_USAGE_ACCOUNTING", True)
# Raw usage rows are kept this long; hourly rollups (what reports read) are kept for good.
LLMGW_USAGE_RETENTION_DAYS: int = _read(env_int, "LLMGW_USAGE_RETENTION_DAYS", 90, minimum=1)
LLMGW_USAGE_ROLLUP_INTERVAL: float = _read(
    env_float, "LLMGW_USAGE_ROLLUP_INTERVAL", 300.0, minimum=1.0
)
# How often the leader lifts budget counters to what the usage records say was spent: a counter
# lost (a Redis restarted without persistence) would otherwise start its period at zero.
LLMGW_BUDGET_REFRESH_INTERVAL: float = _read(
    env_float, "LLMGW_BUDGET_REFRESH_INTERVAL", 60.0, minimum=1.0
)
LLMGW_USAGE_JOURNAL_DIR = Path(env_str(ENV, "LLMGW_USAGE_JOURNAL_DIR", str(VAR_DIR / "usage")))
# SSE comments sent to a stream while it waits for a cold model, so proxies keep it open.
LLMGW_KEEPALIVE_INTERVAL: float = _read(env_float, "LLMGW_KEEPALIVE_INTERVAL", 5.0, minimum=0.05)

# --- metrics (telemetry.metrics) ------------------------------------------------------------
# /metrics answers only "Authorization: Bearer <this>"; unset (the default) turns it off.
LLMGW_METRICS_TOKEN: str = env_str(ENV, "LLMGW_METRICS_TOKEN", "")
# Multiprocess mode: each web process writes its samples under this folder and any of them
# sums all. prometheus_client decides at import time, so it must be in the environment before
# anything imports it; settings load first, and child processes inherit it.
PROMETHEUS_MULTIPROC_DIR = Path(
    env_str(ENV, "PROMETHEUS_MULTIPROC_DIR", str(VAR_DIR / "prometheus"))
)
PROMETHEUS_MULTIPROC_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(PROMETHEUS_MULTIPROC_DIR)
# django-prometheus would query the database while apps load; the fleet gauges cover it.
PROMETHEUS_EXPORT_MIGRATIONS = False

if LLMGW_LEASE_RENEW_DEADLINE >= LLMGW_LEASE_TTL:
    _errors.append(
        f"LLMGW_LEASE_RENEW_DEADLINE ({LLMGW_LEASE_RENEW_DEADLINE:g}s) must be shorter than "
        f"LLMGW_LEASE_TTL ({LLMGW_LEASE_TTL:g}s), or a stale holder could act after expiry"
    )
if LLMGW_RECONCILE_INTERVAL >= LLMGW_LEASE_RENEW_DEADLINE:
    _errors.append(
        f"LLMGW_RECONCILE_INTERVAL ({LLMGW_RECONCILE_INTERVAL:g}s) must be shorter than the "
        f"lease renew deadline ({LLMGW_LEASE_RENEW_DEADLINE:g}s), or the leader cannot renew"
    )
if LLMGW_LOST_AFTER <= LLMGW_UNREACHABLE_AFTER:
    _errors.append(
        f"LLMGW_LOST_AFTER ({LLMGW_LOST_AFTER:g}s) must be longer than "
        f"LLMGW_UNREACHABLE_AFTER ({LLMGW_UNREACHABLE_AFTER:g}s)"
    )

if LLMGW_AGENT_HEARTBEAT_INTERVAL * 2 >= LLMGW_UNREACHABLE_AFTER:
    _errors.append(
        f"LLMGW_AGENT_HEARTBEAT_INTERVAL ({LLMGW_AGENT_HEARTBEAT_INTERVAL:g}s) must be under "
        f"half of LLMGW_UNREACHABLE_AFTER ({LLMGW_UNREACHABLE_AFTER:g}s), or one late "
        "heartbeat would make a healthy node unreachable"
    )

# Beat sends one reconcile tick per interval; a tick not started before the next is due is
# dropped (``expires``), so a worker that was down for ten intervals runs one tick, not ten.
CELERY_BEAT_SCHEDULE = {
    "reconcile": {
        "task": "control.tasks.reconcile",
        "schedule": LLMGW_RECONCILE_INTERVAL,
        "options": {"expires": LLMGW_RECONCILE_INTERVAL * 0.9},
    },
    # Leader-gated like the reconcile tick; idempotent (gateway.ledger.rollups).
    "usage-rollups": {
        "task": "gateway.tasks.roll_up_usage",
        "schedule": LLMGW_USAGE_ROLLUP_INTERVAL,
        "options": {"expires": LLMGW_USAGE_ROLLUP_INTERVAL * 0.9},
    },
    # Leader-gated; lifts counters only, so a repeat is harmless (gateway.identity.budgets).
    "budget-refresh": {
        "task": "gateway.tasks.refresh_budgets",
        "schedule": LLMGW_BUDGET_REFRESH_INTERVAL,
        "options": {"expires": LLMGW_BUDGET_REFRESH_INTERVAL * 0.9},
    },
}


# --- the rest of Django ----------------------------------------------------------------------

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [SITE_FILES_DIR / "static"]
STATIC_ROOT = VAR_DIR / "static"
LOGIN_URL = "/admin/login/"

# --- sign-in protection (django-axes) ------------------------------------------------------------
# Failed sign-ins are counted per (account, address) and per address (either reaching the limit
# locks), at /admin/login/, /account/login/ and on the admin API's tokens; an account tried from
# many addresses is paced, never locked (llmgw_site.signin). A lockout ends after the cool-off
# or when an administrator lifts it (admin: Axes > Access attempts, or
# `manage.py axes_reset_username NAME` / `axes_reset_ip ADDRESS`); `manage.py signin_link NAME`
# prints a one-time way in that neither locks nor pace can stop.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out sign-in outright
    "django.contrib.auth.backends.ModelBackend",
    # Keeps the sessions of one-time sign-in links (never authenticates anything itself).
    "gateway.identity.signin_links.LinkBackend",
]
# Local passwords; off leaves only single sign-on (below).
LLMGW_PASSWORD_LOGIN: bool = _read(env_bool, "LLMGW_PASSWORD_LOGIN", True)
if not LLMGW_PASSWORD_LOGIN:
    AUTHENTICATION_BACKENDS.remove("django.contrib.auth.backends.ModelBackend")
AXES_FAILURE_LIMIT: int = _read(env_int, "LLMGW_LOGIN_FAILURE_LIMIT", 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(
    minutes=_read(env_float, "LLMGW_LOGIN_LOCKOUT_MINUTES", 60.0, minimum=0.01)
)
# Passwords: (account, address) and address; admin tokens: address.
AXES_LOCKOUT_PARAMETERS = "llmgw_site.signin.lockout_parameters"
AXES_HANDLER = "llmgw_site.signin.SignInHandler"  # axes' database handler, and the pace
# A refused attempt is no guess: counted, it would let an attacker keep a lockout or a pace
# going for ever by trying on.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "llmgw_site.signin.lockout_response"
# An account tried from many addresses: one attempt per this long once its burst (twice the
# failure limit) is spent; its owner never waits longer than this after the last attempt.
LLMGW_LOGIN_PACE = timedelta(
    seconds=_read(env_float, "LLMGW_LOGIN_PACE_SECONDS", 300.0, minimum=1.0)
)
# Behind a proxy the client's address is in its header; axes reads REMOTE_ADDR otherwise.

# --- single sign-on (OpenID Connect, llmgw_site.sso); off unless LLMGW_OIDC_ISSUER is set ------
LLMGW_OIDC_ISSUER: str = env_str(ENV, "LLMGW_OIDC_ISSUER", "").rstrip("/")
LLMGW_OIDC_GROUPS_CLAIM: str = env_str(ENV, "LLMGW_OIDC_GROUPS_CLAIM", "groups")
LLMGW_OIDC_STAFF_GROUPS: list[str] = _read(env_list, "LLMGW_OIDC_STAFF_GROUPS", [])
LLMGW_OIDC_SUPERUSER_GROUPS: list[str] = _read(env_list, "LLMGW_OIDC_SUPERUSER_GROUPS", [])
LLMGW_OIDC_CREATE_TEAMS: bool = _read(env_bool, "LLMGW_OIDC_CREATE_TEAMS", False)
OIDC_RP_CLIENT_ID = env_str(ENV, "LLMGW_OIDC_CLIENT_ID", "")
OIDC_RP_CLIENT_SECRET = env_str(ENV, "LLMGW_OIDC_CLIENT_SECRET", "")
OIDC_RP_SIGN_ALGO = env_str(ENV, "LLMGW_OIDC_SIGN_ALGO", "RS256")
OIDC_RP_SCOPES = env_str(ENV, "LLMGW_OIDC_SCOPES", "openid email profile")
OIDC_USE_PKCE = True
OIDC_TIMEOUT: float = _read(env_float, "LLMGW_OIDC_TIMEOUT", 10.0, minimum=0.5)
OIDC_AUTHENTICATE_CLASS = "llmgw_site.sso.Authenticate"
OIDC_CALLBACK_CLASS = "llmgw_site.sso.Callback"
LOGIN_REDIRECT_URL = "/signed-in/"
LOGIN_REDIRECT_URL_FAILURE = "/account/login/?sso=failed"
if LLMGW_OIDC_ISSUER:
    if not LLMGW_OIDC_ISSUER.startswith(("https://", "http://")):
        _errors.append(f"LLMGW_OIDC_ISSUER={LLMGW_OIDC_ISSUER!r} is not an http(s) URL")
    if not OIDC_RP_CLIENT_ID or not OIDC_RP_CLIENT_SECRET:
        _errors.append("LLMGW_OIDC_ISSUER needs LLMGW_OIDC_CLIENT_ID and LLMGW_OIDC_CLIENT_SECRET")
    AUTHENTICATION_BACKENDS.append("llmgw_site.sso.Backend")
elif not LLMGW_PASSWORD_LOGIN:
    _errors.append("LLMGW_PASSWORD_LOGIN=false leaves no way to sign in without LLMGW_OIDC_ISSUER")

LLMGW_CLIENT_IP_HEADER: str = env_str(ENV, "LLMGW_CLIENT_IP_HEADER", "")
AXES_CLIENT_IP_CALLABLE = "llmgw_site.signin.client_ip"

# "plain" lines as always, or "json": one object a line (agents.logs), each line written while
# serving a request with its request id and trace id (telemetry.logs).
LLMGW_LOG_FORMAT: str = _read(env_choice, "LLMGW_LOG_FORMAT", "plain", ("plain", "json"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"},
        "json": {"()": "agents.logs.JsonFormatter", "fields": {"process": LLMGW_PROCESS}},
    },
    "filters": {"request_ids": {"()": "telemetry.logs.RequestIds"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LLMGW_LOG_FORMAT,
            "filters": ["request_ids"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str(ENV, "LLMGW_LOG_LEVEL", "INFO").upper()},
    "loggers": {
        # LLMGW_DEBUG_LOGGERS=control.reconciler,gateway.relay turns up one subsystem at a time.
        **{
            name: {"level": "DEBUG"}
            for name in env_str(ENV, "LLMGW_DEBUG_LOGGERS", "").split(",")
            if name.strip()
        },
        # Access logs would carry full request lines; ours carry ids, never credentials.
        "django.channels.server": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "uvicorn": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
        "celery.beat": {"level": "WARNING"},
        # Every sign-in would log a line; lockouts and failures are warnings and still show.
        "axes": {"level": "WARNING"},
        # Django's own handlers write plain lines (its console one while DEBUG is on, the
        # development server's always): in JSON, everything goes through ours.
        **(
            {
                "django": {"handlers": [], "level": "INFO"},
                "django.server": {"handlers": ["console"], "level": "INFO", "propagate": False},
            }
            if LLMGW_LOG_FORMAT == "json"
            else {}
        ),
    },
}

# Last, so that every malformed variable above is reported at once.
if _errors:
    raise ImproperlyConfigured("llmgw cannot start:\n  " + "\n  ".join(_errors))
