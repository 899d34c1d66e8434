"""The routers under test, each started fresh in front of four fresh engines.

- ``llmgw``: two web processes on one listening socket, started as ``manage.py run
  --router-only --web-processes 2`` starts them (the launcher's socket and argv), serving the
  four engines as ``LLMGW_STATIC_ENDPOINTS``, with its default routing. The bench waits until
  both say they accept (``--ready-fd``, as the launcher does): a process still loading while
  the load begins would take its first connections cold;
- ``llmgw-least-outstanding``: the same with ``LLMGW_ROUTING_POLICY=least_outstanding``;
- ``sglang-cache-aware`` / ``sglang-round-robin``: SGLang's Model Gateway (the Rust
  ``sglang-router``, pinned), ``--policy cache_aware`` with its default thresholds, and
  ``--policy round_robin``. It is never a dependency of ours: the bench installs it into its
  own virtualenv under ``var/`` the first time it is needed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.routing.sims import MODEL
from llmgw_site import launcher
from telemetry import metrics
from tests.harness.procs import REPO_ROOT, Proc, free_port

SGLANG_ROUTER_VERSION = "0.3.2"
SGLANG_ROUTER_VENV = REPO_ROOT / "var" / "sglang-router-venv"
LLMGW_WEB_PROCESSES = 2


@dataclass
class Running:
    """A started router: where clients call it, with which key, and its processes."""

    url: str
    key: str
    procs: list[Proc]
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # what it was given beyond the bench's

    def stop(self) -> None:
        for proc in self.procs:  # all told at once, so they drain side by side
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop()


Starter = Callable[[Sequence[str], Mapping[str, str], str, Path], Running]


@dataclass(frozen=True)
class Target:
    name: str
    start: Starter  # (engine URLs, environment, llmgw key, log folder) -> Running
    sglang: bool = False


def wait_ready(proc: Proc, path: str, ready: Callable[[int, bytes], bool], timeout: float) -> None:
    """Until ``path`` answers so that ``ready(status, body)``; fail with the log if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.running():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(proc.url + path, timeout=5) as response:
                if ready(response.status, response.read()):
                    return
        except urllib.error.HTTPError as err:
            if ready(err.code, err.read()):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready on {path} after {timeout:.0f}s:\n{proc.tail()}")


def wait_accepting(proc: Proc, ready: int, timeout: float) -> None:
    """Until the web process writes its byte to ``ready``; fail with its log if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.running():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        readable, _, _ = select.select([ready], [], [], 0.5)
        if readable:
            if os.read(ready, 1) == b"1":
                return
            raise RuntimeError(f"{proc.name} closed its ready pipe:\n{proc.tail()}")
    raise RuntimeError(f"{proc.name} not accepting after {timeout:.0f}s:\n{proc.tail()}")


def llmgw(extra: Mapping[str, str]) -> Starter:
    """llmgw router-only, with ``extra`` in its environment."""

    def start(urls: Sequence[str], env: Mapping[str, str], key: str, log_dir: Path) -> Running:
        endpoints = " ".join(f"sim{i}={url}={MODEL}" for i, url in enumerate(urls, 1))
        given = {"LLMGW_STATIC_ENDPOINTS": endpoints, **extra}
        environ = {**env, **given}
        metrics.reset_multiprocess_dir()  # this process has Django set up: the same folder
        listener = launcher.bind_listener("127.0.0.1", 0)
        port = int(listener.getsockname()[1])
        argv = launcher.web_command({"client": listener.fileno()})
        procs: list[Proc] = []
        pipes: list[int] = []
        try:
            for n in range(1, LLMGW_WEB_PROCESSES + 1):
                ready, write_end = os.pipe()
                pipes.append(ready)
                web_argv = [*argv, "--ready-fd", str(write_end)]
                proc = Proc(f"llmgw-web{n}", web_argv, log_dir, environ, port=port)
                procs.append(proc)
                try:
                    proc.start(pass_fds=(listener.fileno(), write_end))
                finally:
                    os.close(write_end)
            for proc, ready in zip(procs, pipes, strict=True):
                wait_accepting(proc, ready, timeout=120)
        except BaseException:
            Running("", key, procs, argv).stop()
            raise
        finally:
            listener.close()  # the children have it: when they go, connections are refused
            for ready in pipes:
                os.close(ready)
        return Running(f"http://127.0.0.1:{port}", key, procs, argv, dict(given))

    return start


def sglang_python() -> Path:
    return SGLANG_ROUTER_VENV / "bin" / "python"


def installed_version(python: Path) -> str:
    if not python.exists():
        return ""
    probe = "import importlib.metadata as m; print(m.version('sglang-router'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def ensure_sglang_router() -> str:
    """Install the pinned ``sglang-router`` into its virtualenv unless it is there: "" when
    ready, else why it cannot be (the sglang targets are then skipped)."""
    python = sglang_python()
    if installed_version(python) == SGLANG_ROUTER_VERSION:
        return ""
    print(f"installing sglang-router=={SGLANG_ROUTER_VERSION} into {SGLANG_ROUTER_VENV}")
    steps = []
    if not python.exists():
        steps.append([sys.executable, "-m", "venv", str(SGLANG_ROUTER_VENV)])
    steps.append(
        [str(python), "-m", "pip", "install", "--quiet", f"sglang-router=={SGLANG_ROUTER_VERSION}"]
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"skipped: {' '.join(step[-2:])} failed: {done.stderr.strip()[-300:]}"
    return ""


def sglang(policy: str) -> Starter:
    """SGLang's Model Gateway with ``policy``, every other setting its default (cache_aware's
    cache threshold 0.3, balance thresholds 64 absolute and 1.5 relative, retries on); its
    own log at ``warn``, as llmgw's web processes log at WARNING."""

    def start(urls: Sequence[str], env: Mapping[str, str], key: str, log_dir: Path) -> Running:
        port = free_port()
        argv = [str(SGLANG_ROUTER_VENV / "bin" / "sglang-router"), "launch"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        argv += ["--policy", policy, "--log-level", "warn"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        clean = {
            k: v for k, v in env.items() if not k.startswith(("DATABASE_URL", "DJANGO", "PYTHON"))
        }
        proc = Proc(f"sglang-{policy}", argv, log_dir, clean, port=port).start()

        def all_healthy(status: int, body: bytes) -> bool:
            if status != 200:
                return False
            return int(json.loads(body).get("healthy_workers", 0)) == len(urls)

        try:
            wait_ready(proc, "/readiness", all_healthy, timeout=60)
        except BaseException:
            proc.stop()
            raise
        return Running(proc.url, "", [proc], argv)

    return start


TARGETS: tuple[Target, ...] = (
    Target("llmgw", llmgw({})),
    Target("llmgw-least-outstanding", llmgw({"LLMGW_ROUTING_POLICY": "least_outstanding"})),
    Target("sglang-cache-aware", sglang("cache_aware"), sglang=True),
    Target("sglang-round-robin", sglang("round_robin"), sglang=True),
)
