"""What ``make bench`` measures: the ``sim`` engine (L0) and every server in front of it, each
started, pinned to its CPU and kept in a :class:`Stack`, over a fresh SQLite store with one key;
with a baseline tree, one more: L2 running that tree's code (``L2-baseline``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import fresh_store
from llmgw_site import launcher
from tests.harness.procs import Proc, free_port, web_process

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "var" / "bench"
MODEL = "bench"
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    name: str
    url: str  # base, without /v1
    proc: Proc | None = None
    key: str = ""  # a key of its own (LiteLLM's master key), else the stack's

    def cpu_seconds(self) -> float:
        """CPU of the server and its worker processes (granian serves from a child)."""
        if self.proc is None:
            return 0.0
        total = 0.0
        for pid in process_tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / TICKS
        return total

    def rss_mib(self) -> float:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0


@dataclass
class Stack:
    key: str
    targets: dict[str, Target]
    procs: list[Proc] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    baseline: dict[str, str] = field(default_factory=dict)  # which tree L2-baseline runs

    def stop(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return out


# BENCH_PIN=0 leaves every process free to run on any core: on a machine others load, a
# pinned process waits for its one core, and a server that sleeps between requests pays that
# wake-up where one that spins does not (so the pinned latencies favour spinning servers).
PINNING = os.environ.get("BENCH_PIN", "1") != "0"


def pin(proc: Proc, cpu: int) -> Proc:
    if PINNING and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        for pid in process_tree(proc.pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, {cpu})
    return proc


def granian(name: str, app: str, env: dict[str, str]) -> Proc:
    """One granian worker on its own port (it binds its own socket), uvloop, one thread."""
    port = free_port()
    argv = [
        str(Path(sys.executable).with_name("granian")),
        *("--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)),
        *("--workers", "1", "--runtime-mode", "st", "--loop", "uvloop", "--no-ws"),
        *("--log-level", "warning", app),
    ]
    return Proc(name, argv, WORK, env, port=port).start().wait_answering()


LITELLM_KEY = "sk-bench-" + "0" * 32


def litellm(program: str, upstream: str, env: dict[str, str]) -> Proc:
    """LiteLLM's proxy in front of the same engine, one worker: the side-by-side target. It is
    never a dependency of ours: ``LITELLM_BIN`` names a ``litellm`` from its own virtualenv."""
    port = free_port()
    config = WORK / "litellm.yaml"
    model = {"model": f"openai/{MODEL}", "api_base": upstream + "/v1", "api_key": "none"}
    config.write_text(
        json.dumps(
            {
                "model_list": [{"model_name": MODEL, "litellm_params": model}],
                "general_settings": {"master_key": LITELLM_KEY},
            }
        )
    )
    argv = [program, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", "1"]
    clean = {
        k: v for k, v in env.items() if not k.startswith(("DATABASE_URL", "DJANGO", "PYTHONPATH"))
    }
    # Its bundled price list, not one fetched at start (with no network, three retries).
    clean["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    proc = Proc("litellm", argv, WORK, clean, port=port).start()
    return proc.wait_answering("/health/liveliness", timeout=180)


def daphne(name: str, app: str, env: dict[str, str]) -> Proc:
    port = free_port()
    argv = [str(Path(sys.executable).with_name("daphne")), "-b", "127.0.0.1", "-p", str(port)]
    argv += ["--verbosity", "0", app]
    return Proc(name, argv, WORK, env, port=port).start().wait_answering()


def start_engine(stack: Stack, env: dict[str, str]) -> Proc:
    """The ``sim`` engine (L0) on CPU 0, and the model routed to it."""
    from tests.harness.factories import serve_model  # after django.setup()

    port = free_port()
    # No cap on running requests: the held-streams levels (up to 1,000 streams) measure the
    # gateway, not an engine's queue (the sim, like vLLM, runs 256 at a time by default).
    argv = [sys.executable, "-m", "agents.sim", "--port", str(port), "--model", MODEL]
    argv += ["--max-num-seqs", "0"]
    sim = Proc("sim", argv, WORK, env, port=port).start()
    stack.procs.append(sim)
    pin(sim.wait_listening(), cpu=0)
    serve_model(MODEL, [sim.port])
    stack.targets["L0"] = Target("L0", sim.url, sim)
    return sim


def start_gateway(
    stack: Stack, name: str, env: dict[str, str], *, app: str = "", cwd: Path = REPO
) -> None:
    """One web process as ``manage.py run`` starts it (serving ``app`` instead of llmgw's, or
    ``cwd``'s code), on CPU 1, kept in ``stack`` as target ``name``."""
    web = web_process(name, WORK, env, app=app, cwd=cwd)
    stack.procs.append(pin(web, cpu=1))
    stack.targets[name] = Target(name, web.url, web)


def start_otlp_receiver(stack: Stack, env: dict[str, str]) -> str:
    """An OTLP/HTTP receiver that counts what it gets and decodes none (``tests.harness.otlp``),
    on CPU 0 beside the engine; what ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set to."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.harness.otlp", "--port", str(port), "--count-only"]
    receiver = Proc("otlp", argv, WORK, env, port=port).start()
    stack.procs.append(pin(receiver.wait_listening(), cpu=0))
    return receiver.url + "/v1/traces"


def start_tracing_targets(stack: Stack, env: dict[str, str]) -> None:
    """L2 with tracing on, recording and exporting every span (the SDK's defaults otherwise),
    and with 1% of the traces sampled (``parentbased_traceidratio``: what a busy deployment
    would run)."""
    traced = {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": start_otlp_receiver(stack, env)}
    sampled = {
        **traced,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    for name, target_env in (("L2-traced", traced), ("L2-traced-1%", sampled)):
        start_gateway(stack, name, target_env)


def start_targets(stack: Stack, env: dict[str, str], baseline: Path | None = None) -> None:
    """The engine (L0) and every gateway in front of it, each kept in ``stack`` as it starts;
    L2-baseline right after L2, so that in every round the two take their turns side by side."""
    sim = start_engine(stack, env)
    # Every gateway is the web server `manage.py run` starts (the launcher's argv); L1 and the
    # stock handler only serve another application on it.
    variants = {
        "L1": ("bench.relay:app", {"BENCH_UPSTREAM": sim.url}),
        "L2": ("", {}),
        "L2-no-usage": ("", {"LLMGW_USAGE_ACCOUNTING": "false"}),
        # What having the processes' diagnostics available costs while nobody asks for them.
        "L2-no-diagnostics": ("", {"LLMGW_DIAGNOSTICS": "false"}),
        "L2-stock-handler": ("bench.stock:app", {}),
    }
    for name, (app, extra) in variants.items():
        start_gateway(stack, name, {**env, **extra}, app=app)
        if name == "L2" and baseline is not None:
            start_baseline(stack, env, baseline, sim)
    start_tracing_targets(stack, env)
    relay_env = {**env, "BENCH_UPSTREAM": sim.url}

    def keep(name: str, proc: Proc, key: str = "") -> None:
        stack.procs.append(pin(proc, cpu=1))
        stack.targets[name] = Target(name, proc.url, proc, key)

    keep("L2-daphne", daphne("L2-daphne", "llmgw_site.asgi:application", env))
    if Path(sys.executable).with_name("granian").exists():
        keep("L1-granian", granian("L1-granian", "bench.relay:app", relay_env))
        keep("L2-granian", granian("L2-granian", "llmgw_site.asgi:application", env))
        keep("hello-granian", granian("hello-granian", "bench.hello:app", env))
    else:
        print("granian is not installed (requirements-dev.txt): its rows are skipped")
    keep("hello-uvicorn", web_process("hello-uvicorn", WORK, env, app="bench.hello:app"))
    litellm_bin = os.environ.get("LITELLM_BIN")
    if litellm_bin:
        keep("litellm", litellm(litellm_bin, sim.url, env), LITELLM_KEY)
    else:
        stack.skipped["litellm"] = (
            "skipped: set LITELLM_BIN to a litellm[proxy] install's `litellm`"
        )


# Run by the baseline tree's own code (its directory the working one and the only one on
# PYTHONPATH): the argv its launcher builds for a web process accepting on the descriptor
# argv[1]; given a user, a model and an engine port, first its own store, migrated by its own
# migrations, with a key of that user's and the model routed to that engine.
BASELINE_SETUP = """
import json, sys
import django
django.setup()
from llmgw_site import launcher
told = {"argv": launcher.web_command({"client": int(sys.argv[1])})}
if len(sys.argv) > 2:
    from django.core.management import call_command
    from tests.harness.factories import make_key, serve_model
    call_command("migrate", verbosity=0)
    told["key"] = make_key(sys.argv[2])[0]
    serve_model(sys.argv[3], [int(sys.argv[4])])
print(json.dumps(told))
"""


def migrations(root: Path) -> dict[str, bytes]:
    """Every app's migration files under ``root``, by path: two trees with the same files read
    the same store."""
    found = [*root.glob("*/migrations/*.py"), *root.glob("*/*/migrations/*.py")]
    return {str(path.relative_to(root)): path.read_bytes() for path in found}


def start_baseline(stack: Stack, env: dict[str, str], tree: Path, sim: Proc) -> None:
    """L2 again, running ``tree``'s code: the web process its own launcher builds (this
    virtualenv's Python, ``tree`` the working directory and PYTHONPATH, so every import
    resolves there), on the same server and settings, pinned with L2. It shares L2's store and
    key when its migrations are ours; else it gets its own store, migrated by its own code
    (its models may not read ours), with its own key and the same engine routed."""
    # The tree is only read: Python's caches of its modules go beside the bench's files.
    own_env = {**env, "PYTHONPATH": str(tree), "PYTHONPYCACHEPREFIX": str(WORK / "pycache")}
    shared = migrations(tree) == migrations(REPO)
    store_args: list[str] = []
    store = "L2's store and key"
    if not shared:
        store = "a store and key of its own (its migrations differ from ours)"
        var = WORK / "baseline"
        var.mkdir(parents=True, exist_ok=True)
        own_env.update(DATABASE_URL=f"sqlite:///{var / 'bench.sqlite3'}", LLMGW_VAR_DIR=str(var))
        store_args = ["bench", MODEL, str(sim.port)]
    listener = launcher.bind_listener("127.0.0.1", 0)
    try:
        made = subprocess.run(
            [sys.executable, "-c", BASELINE_SETUP, str(listener.fileno()), *store_args],
            check=False,  # its own errors are raised below, with what it said
            cwd=tree,
            env=own_env,
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise RuntimeError(f"the baseline in {tree} did not set up:\n{made.stderr}")
        told = json.loads(made.stdout.splitlines()[-1])
        port = int(listener.getsockname()[1])
        web = Proc("L2-baseline", told["argv"], WORK, own_env, port=port, cwd=tree)
        web.start(pass_fds=(listener.fileno(),))
    finally:
        listener.close()
    stack.procs.append(web)  # stopped with the others even if it never answers
    pin(web.wait_answering(), cpu=1)
    stack.targets["L2-baseline"] = Target("L2-baseline", web.url, web, told.get("key", ""))
    commit = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        check=False,  # a tree that is no git checkout has no commit to name
        capture_output=True,
        text=True,
    )
    stack.baseline = {
        "dir": str(tree),
        "commit": commit.stdout.strip(),
        "store": store,
    }


def prepare() -> tuple[dict[str, str], str]:
    """A fresh SQLite store with one key; the environment every process gets (without this
    shell's OTEL_ variables: only the traced target traces)."""
    env, key = fresh_store(WORK, "bench")
    return {name: value for name, value in env.items() if not name.startswith("OTEL_")}, key


def started(start: Callable[[Stack, dict[str, str]], object]) -> Stack:
    """A fresh store, then ``start``'s processes; this process on CPU 0 with the engine."""
    env, key = prepare()
    stack = Stack(key, {})
    try:
        start(stack, env)
    except BaseException:
        stack.stop()  # a target that failed to start must not leave the others running
        raise
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        if PINNING:
            os.sched_setaffinity(0, {0})
    return stack


def setup(baseline: Path | None = None) -> Stack:
    """The engine and every gateway in front of it; L2-baseline too, given a tree."""
    return started(lambda stack, env: start_targets(stack, env, baseline))


def setup_tracing() -> Stack:
    """The engine, L2, and the tracing targets (``bench.tracing``)."""

    def start(stack: Stack, env: dict[str, str]) -> None:
        start_engine(stack, env)
        start_gateway(stack, "L2", env)
        start_tracing_targets(stack, env)

    return started(start)


def setup_engine_and_gateway() -> Stack:
    """The engine and one llmgw web process (L2) only (``bench.profile``)."""

    def start(stack: Stack, env: dict[str, str]) -> None:
        start_engine(stack, env)
        start_gateway(stack, "L2", env)

    return started(start)
