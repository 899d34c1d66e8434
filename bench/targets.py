"""What ``make bench`` measures: the ``sim`` engine (L0) and every server in front of it, each
started, pinned to its CPU and kept in a :class:`Stack`, over a fresh SQLite store with one key.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import fresh_store
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
    would run); and, when ``BENCH_BASELINE`` names a checkout of another commit (``git worktree
    add`` or ``git archive``), L2 served from that code: tracing off against the code before."""
    traced = {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": start_otlp_receiver(stack, env)}
    sampled = {
        **traced,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    targets = {"L2-traced": (traced, REPO), "L2-traced-1%": (sampled, REPO)}
    baseline = os.environ.get("BENCH_BASELINE")
    if baseline:
        targets["L2-baseline"] = (env, Path(baseline).resolve())
    for name, (target_env, code) in targets.items():
        start_gateway(stack, name, target_env, cwd=code)


def start_targets(stack: Stack, env: dict[str, str]) -> None:
    """The engine (L0) and every gateway in front of it, each kept in ``stack`` as it starts."""
    sim = start_engine(stack, env)
    # Every gateway is the web server `manage.py run` starts (the launcher's argv); L1 and the
    # stock handler only serve another application on it.
    variants = {
        "L1": ("bench.relay:app", {"BENCH_UPSTREAM": sim.url}),
        "L2": ("", {}),
        "L2-no-usage": ("", {"LLMGW_USAGE_ACCOUNTING": "false"}),
        "L2-stock-handler": ("bench.stock:app", {}),
    }
    for name, (app, extra) in variants.items():
        start_gateway(stack, name, {**env, **extra}, app=app)
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


def setup() -> Stack:
    """The engine and every gateway in front of it."""
    return started(start_targets)


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
