"""`manage.py run` (what `make run` calls): the whole of llmgw on this machine, one command.

Migrates the store, makes sure an administrator exists (printing a new one's password once),
adds a demo model to an empty catalog, issues a fresh demo API key and a token for the local
node, then starts and supervises the web processes (one port), the Celery worker and beat (the
reconciler) and a local agent (real GPUs through NVML when present, simulated ones otherwise),
until Ctrl-C stops them all.

``--router-only`` is the gateway alone, in front of engines llmgw does not run: web processes
only (no worker, beat, agent or demo model), serving ``LLMGW_STATIC_ENDPOINTS``, the
``--endpoint`` flags and the Endpoint rows; it refuses to start when there is none.

``--endpoint id=URL=model[,model]`` (repeatable) adds a static endpoint to those of
``LLMGW_STATIC_ENDPOINTS``, in its format: the two add up, and an id given twice is refused.
``--catalog FILE`` applies a catalog file (``export_catalog``'s format, YAML or JSON) at every
start, as ``import_catalog`` does: what the file names is created or updated, what it does not
name (models added in the admin or through the API) stays.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from control import node_tokens
from control.models import Event, Profile, ServedModel
from gateway.identity import keys
from gateway.models import ApiKey, Endpoint
from llmgw_site import catalog, launcher, listeners, owner_only, startup
from llmgw_site.config import (
    ConfigError,
    StaticEndpoint,
    static_endpoints_text,
    static_endpoints_with_flags,
)
from telemetry import metrics

DEMO_KEY_NAME = "make run demo"
LOCAL_NODE = "local"


def ensure_admin(username: str = "admin") -> str | None:
    """Create a superuser when there is none; return its new password, or None if one exists.

    A user who is not a superuser may hold the name already (made by ``create_user`` or the
    admin): the new one takes the first free name after it (``admin-2``...), never that
    user's account, which a start-up must not raise to superuser nor give a new password."""
    user_model = get_user_model()
    if user_model.objects.filter(is_superuser=True).exists():
        return None
    taken = set(
        user_model.objects.filter(username__startswith=username).values_list("username", flat=True)
    )
    free, n = username, 1
    while free in taken:
        n += 1
        free = f"{username}-{n}"
    password = secrets.token_urlsafe(12)
    user_model.objects.create_superuser(username=free, email="", password=password)
    return password


def ensure_demo_model() -> str:
    """An empty catalog gets one scale-from-zero model on the simulated engine."""
    existing = ServedModel.objects.filter(enabled=True).order_by("name").first()
    if existing is not None:
        return existing.name
    with transaction.atomic():
        profile, _ = Profile.objects.get_or_create(
            name="sim-demo",
            defaults={
                "engine": "sim",
                "args": ["--ttft-ms", "50", "--itl-ms", "20", "--output-tokens", "24"],
                "gpus_per_shard": 1,
                "startup_timeout_s": 60,
            },
        )
        model = ServedModel.objects.create(
            name="demo",
            source="llmgw/demo",
            default_profile=profile,
            min_replicas=0,
            max_replicas=1,
            idle_timeout_s=300,
            activation_timeout_s=60,
        )
        model.profiles.add(profile)
        Event.objects.create(
            kind=Event.Kind.OPERATOR,
            subject="model/demo",
            message="demo model added to an empty catalog by `manage.py run`",
        )
    return model.name


def static_endpoints(flags: Sequence[str]) -> tuple[StaticEndpoint, ...]:
    """``LLMGW_STATIC_ENDPOINTS`` and the ``--endpoint`` flags together (they add up)."""
    try:
        return static_endpoints_with_flags(
            os.environ, "LLMGW_STATIC_ENDPOINTS", "--endpoint", flags
        )
    except ConfigError as exc:
        raise CommandError(str(exc)) from None


def hand_down_static_endpoints(endpoints: Sequence[StaticEndpoint]) -> None:
    """The processes this one starts read their static endpoints from the variable: it is
    set to the variable's and the flags' together."""
    os.environ["LLMGW_STATIC_ENDPOINTS"] = static_endpoints_text(endpoints)


def apply_catalog(path: str) -> catalog.ImportResult:
    """The ``--catalog`` file, imported as ``import_catalog`` imports it (all or nothing, and
    safe beside another control plane applying it at the same moment); a bad file stops the
    start, naming the file, the entry and the field."""
    try:
        return catalog.import_file(Path(path))
    except OSError as exc:
        raise CommandError(f"--catalog: cannot read {path}: {exc.strerror}") from None
    except catalog.CatalogError as exc:
        at = f" (field {exc.field})" if exc.field else ""
        raise CommandError(
            f"--catalog {path}: {exc}{at}; nothing was imported and llmgw did not start"
        ) from None


def router_only_models(static: Sequence[StaticEndpoint] | None = None) -> list[str]:
    """The model names a router-only run serves: its static endpoints' (by default
    ``LLMGW_STATIC_ENDPOINTS``') and enabled rows'."""
    given = settings.LLMGW_STATIC_ENDPOINTS if static is None else static
    names = {name for endpoint in given for name in endpoint.models}
    for row in Endpoint.objects.filter(enabled=True).values_list("model_names", flat=True):
        names.update(str(name) for name in (row or []) if isinstance(name, str) and name)
    return sorted(names)


def issue_demo_key(username: str) -> str:
    """A fresh key for this run's curl line; the previous run's demo key is revoked."""
    for key_id in ApiKey.objects.filter(name=DEMO_KEY_NAME, revoked_at__isnull=True).values_list(
        "pk", flat=True
    ):
        keys.revoke(key_id)
    return keys.issue(username, name=DEMO_KEY_NAME).key


def write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")


def agent_argv(control_plane: str, host: str, token_file: Path, agent_dir: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "agents",
        "--control-plane",
        control_plane,
        "--token-file",
        str(token_file),
        "--node",
        LOCAL_NODE,
        "--state-dir",
        str(agent_dir / "state"),
        "--weights-dir",
        str(agent_dir / "weights"),
        "--port-range",
        "{}-{}".format(*settings.LLMGW_PORT_RANGE),
    ]
    if host in {"127.0.0.1", "localhost", "::1"}:
        # A loopback control plane means a one-machine install: keep engines off the network.
        argv += ["--advertise-address", "127.0.0.1", "--engine-host", "127.0.0.1"]
    else:
        # The local agent dials this very machine: its stream never crosses the network.
        argv += ["--insecure"]
    # Real GPUs through NVML when the node has them, two simulated ones (and `sim`) when not.
    argv += ["--fallback-gpus", "2x80GiB"]
    return argv


def celery_argv(*args: str) -> list[str]:
    # Logging goes through Django's LOGGING (the worker does not hijack it): decisions at
    # INFO, Celery's per-task lines turned down.
    return [sys.executable, "-m", "celery", "--quiet", "-A", "llmgw_site", *args]


def parse_listen(option: str, raw: str) -> tuple[str, int]:
    """``ADDR:PORT``, ``[v6]:PORT`` or a bare ``PORT`` (then loopback: a split listener is
    private unless an address says otherwise)."""
    address, _, number = raw.rpartition(":")
    address = address.strip("[]") or "127.0.0.1"
    if not number.isdigit() or not 0 < int(number) < 65536:
        raise CommandError(f"{option} {raw!r}: expected ADDR:PORT or PORT")
    return address, int(number)


def url_of(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class Command(BaseCommand):
    help = (
        "Start llmgw on this machine: migrate, make an admin if needed, then run the web "
        "processes, the reconciler (Celery worker and beat) and a local agent until Ctrl-C."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=os.environ.get("LLMGW_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("LLMGW_PORT", "8000")))
        parser.add_argument(
            "--web-processes",
            type=int,
            default=int(os.environ.get("LLMGW_WEB_PROCESSES", str(os.cpu_count() or 1))),
            help="Web processes sharing the port (default: one per core).",
        )
        parser.add_argument(
            "--no-agent", action="store_true", help="Do not start a local agent on this machine."
        )
        parser.add_argument(
            "--admin-listen",
            metavar="[ADDR:]PORT",
            default=os.environ.get("LLMGW_ADMIN_LISTEN", ""),
            help="Serve the admin, its dashboard and /account/ here (address 127.0.0.1 unless "
            "given), and not on the client port.",
        )
        parser.add_argument(
            "--metrics-listen",
            metavar="[ADDR:]PORT",
            default=os.environ.get("LLMGW_METRICS_LISTEN", ""),
            help="Serve /metrics here, without a token, and nothing else; not on the client port.",
        )
        parser.add_argument(
            "--agent-listen",
            metavar="[ADDR:]PORT",
            default=settings.LLMGW_AGENT_LISTEN,
            help="Serve the agents' gRPC stream here (manage.py serve_agents_grpc, mutual TLS "
            "with the cluster CA); default LLMGW_AGENT_LISTEN, unset: none.",
        )
        parser.add_argument(
            "--agent-ws-listen",
            metavar="[ADDR:]PORT",
            default=os.environ.get("LLMGW_AGENT_WS_LISTEN", ""),
            help="Accept agents' WebSocket streams here, and not on the client port.",
        )
        parser.add_argument(
            "--endpoint",
            dest="endpoints",
            action="append",
            default=[],
            metavar="ID=URL=MODEL[,MODEL]",
            help="A static upstream, as in LLMGW_STATIC_ENDPOINTS (repeatable; adds to the "
            "variable's; an id given twice is refused).",
        )
        parser.add_argument(
            "--catalog",
            dest="catalog_file",
            metavar="FILE",
            default="",
            help="Apply this catalog file (export_catalog's format, YAML or JSON) at start, as "
            "import_catalog does: creates and updates what it names, deletes nothing.",
        )
        parser.add_argument(
            "--router-only",
            action="store_true",
            help="Only the gateway, in front of LLMGW_STATIC_ENDPOINTS and the admin's Endpoints: "
            "no reconciler worker or beat, no agent, no demo model.",
        )

    def handle(
        self,
        *args: Any,
        host: str,
        port: int,
        web_processes: int,
        no_agent: bool,
        admin_listen: str,
        metrics_listen: str,
        agent_listen: str,
        agent_ws_listen: str,
        endpoints: list[str],
        catalog_file: str,
        router_only: bool,
        **opts: Any,
    ) -> None:
        if web_processes < 1:
            raise CommandError("--web-processes must be at least 1")
        static = static_endpoints(endpoints)
        if settings.LLMGW_AGENT_REQUIRE_IDENTITY and not (no_agent or router_only):
            # The local agent would be refused at every try, its shards never placed.
            raise CommandError(
                "LLMGW_AGENT_REQUIRE_IDENTITY refuses node tokens on every transport, and the "
                "local agent connects with one: give --no-agent (and connect agents over gRPC "
                "with node certificates), or set LLMGW_AGENT_GRPC_REQUIRE_IDENTITY instead to "
                "ask certificates of the gRPC listener only"
            )
        # Before the store is opened: what an older version left open to others is closed.
        owner_only.tighten(owner_only.llmgw_paths())
        addresses = {"client": (host, port)}
        # Each listener as the operator gave it, for a refusal to name.
        given = {f"--host {host} --port {port}": (host, port)}
        for role, raw in (
            ("admin", admin_listen),
            ("metrics", metrics_listen),
            ("agent", agent_ws_listen),
        ):
            if raw:
                flag = "--agent-ws-listen" if role == "agent" else f"--{role}-listen"
                addresses[role] = given[f"{flag} {raw}"] = parse_listen(flag, raw)
        # The gRPC listener is a process of its own that binds its port itself.
        grpc_address = parse_listen("--agent-listen", agent_listen) if agent_listen else None
        if grpc_address:
            given[f"--agent-listen {agent_listen}"] = grpc_address
        shared = listeners.sharing_a_port(given)
        if shared:
            # The web process would tell them apart by address, but a firewall rule or a
            # balancer by port would not: one meant for the public port opens the admin too.
            shared_port, names = shared
            raise CommandError(
                f"{' and '.join(names)} share port {shared_port}: give each listener a port "
                "of its own, whatever its address"
            )
        # Control planes started together on one store migrate and create one at a time
        # (llmgw_site.startup says why); the ones after the first find it all done.
        with startup.one_at_a_time():
            call_command("migrate", interactive=False, verbosity=0)
            # Before the demo model, which an empty catalog gets, and the router-only check,
            # which counts the file's endpoints.
            applied = apply_catalog(catalog_file) if catalog_file else None
            served = router_only_models(static) if router_only else []
            if router_only and not served:
                raise CommandError(
                    "--router-only has nothing to serve: set LLMGW_STATIC_ENDPOINTS or give "
                    "--endpoint (id=URL=model[,model]), or add an enabled Endpoint in the admin"
                )
            password = ensure_admin()
            admin_name = (
                get_user_model()
                .objects.filter(is_superuser=True)
                .order_by("pk")
                .values_list("username", flat=True)
                .first()
            )
            assert admin_name is not None
            demo_model = served[0] if router_only else ensure_demo_model()
            api_key = issue_demo_key(admin_name)
        # Requests a killed earlier run left in its usage journal get their rows now (each
        # exactly once), before any web process starts writing new ones.
        call_command("replay_usage", verbosity=0)
        # Metric sums restart with the web tier, not with files of an earlier run.
        metrics.reset_multiprocess_dir()
        sockets = {}
        for role, (address, number) in addresses.items():
            try:
                sockets[role] = launcher.bind_listener(address, number)
            except OSError as exc:
                raise CommandError(f"cannot listen on {address}:{number}: {exc.strerror}") from None
        bases = {role: url_of(*address) for role, address in addresses.items()}
        base = bases["client"]
        admin_base = bases[listeners.listener_of("admin", bases)]
        hand_down_static_endpoints(static)
        env = dict(os.environ)
        children = launcher.web_children(
            sockets, web_processes, access_log=settings.LLMGW_ACCESS_LOG
        )
        if not router_only:
            schedule = str(settings.VAR_DIR / "celerybeat-schedule")
            children.append(launcher.Child("worker", celery_argv("worker", "--pool", "solo"), env))
            children.append(
                launcher.Child("beat", celery_argv("beat", "--schedule", schedule), env)
            )
        if grpc_address and not router_only:
            grpc_host, grpc_port = grpc_address
            where = f"[{grpc_host}]:{grpc_port}" if ":" in grpc_host else f"{grpc_host}:{grpc_port}"
            # manage.py's commands, in a checkout and where the wheel is installed alike.
            argv = [sys.executable, "-m", "llmgw_site", "serve_agents_grpc", "--listen", where]
            children.append(launcher.Child("agent-grpc", argv, env))
        if not (no_agent or router_only):
            agent_dir = settings.VAR_DIR / "agent"
            token_file = agent_dir / "token"
            # Held again so that the file is the token the node's row holds: another run on
            # this var folder replaces both, never one of them in between.
            with startup.one_at_a_time():
                write_secret(token_file, node_tokens.issue_node_token(LOCAL_NODE))
            agent_env = {k: v for k, v in env.items() if k not in {"DATABASE_URL", "SECRET_KEY"}}
            children.append(
                launcher.Child(
                    "agent",
                    agent_argv(
                        bases[listeners.listener_of("agent", bases)], host, token_file, agent_dir
                    ),
                    agent_env,
                )
            )

        backend = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        write = self.stdout.write
        write(f"llmgw {settings.LLMGW_VERSION} on {backend}")
        if router_only:
            write(f"  web processes: {web_processes} on {base}  (router only)")
            write(f"  serving:       {', '.join(served)}")
        else:
            write(f"  web processes: {web_processes} on {base}  (+ reconciler worker and beat)")
        if not (no_agent or router_only):
            write(f"  local agent:   node '{LOCAL_NODE}': GPUs through NVML, else 2 simulated")
        if static:
            write(f"  endpoints:     {', '.join(f'{e.id} ({e.url})' for e in static)}")
        if applied is not None:
            write(f"  catalog:       {catalog_file}: {applied.summary()}")
        write(f"  health:        {base}/healthz")
        write(f"  admin:         {admin_base}/admin/")
        if "metrics" in bases:
            write(f"  metrics:       {bases['metrics']}/metrics  (no token: for scrapers only)")
        if "agent" in bases:
            write(f"  agents:        {bases['agent']}  (WebSocket)")
        if grpc_address and not router_only:
            write(f"  agents:        {url_of(*grpc_address)}  (gRPC)")
        if password:
            write(
                f"  admin user:    {admin_name} / {password}   (shown once; change it in the admin)"
            )
        else:
            write(f"  admin user:    {admin_name} (its password was shown when it was created)")
        write(f"  API key:       {api_key}   (new for this run; the previous demo key is revoked)")
        write(f"  OpenAI base_url for clients: {base}/v1")
        if not router_only:
            write("  try it (the first request starts the model, then it answers):")
        else:
            write("  try it:")
        body = json.dumps({"model": demo_model, "messages": [{"role": "user", "content": "Hello"}]})
        write(
            f"    curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
            f"-H 'Content-Type: application/json' -d '{body}'"
        )
        write(
            "Ctrl-C stops everything (requests in flight finish first); "
            f"`kill -HUP {os.getpid()}` restarts the web processes one at a time."
        )
        self.stdout.flush()
        launcher.Supervisor(
            children, stop_grace=settings.LLMGW_SHUTDOWN_GRACE, listeners=list(sockets.values())
        ).run()
