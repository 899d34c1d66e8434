"""The four engines every target routes to: ``sim`` replicas with a prefix cache, their settings
in one table, and what each engine reports about itself (``/metrics``).

The engine is modelled on a real vLLM serving an 8B model on one GPU, scaled down in one place
only: its KV cache holds 512 usable blocks of 16 tokens (8,192 tokens; vLLM keeps one more, its
null block), so about five of the eight shared system prompts fit on one replica with nothing
running and two or three beside a full batch: round robin keeps evicting them, a router that
gives each prompt a home keeps them all. The same blocks hold what runs, as on vLLM, so a
replica given too many long histories at once also queues and preempts. Prefill runs at 10,000
tokens a second, one prompt at a time (a 1,500-token miss costs 150 ms, the same prompt cached
about 5 ms); a decode step takes 12 ms plus 0.25 ms per further running sequence (20 ms with
the 32 sequences ``--max-num-seqs`` allows); more requests wait in the queue.

A ``sim`` without the cache model (its ``--help`` lacks the capacity flag) gets the fallback
rows instead: a fixed time to first token of one uncached shared prompt and the full batch's
step as the gap between tokens. Every target then sees the same engine and only the spread of
load differs, which is enough to develop the bench against; hit ratios read "n/a".
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tests.harness.procs import REPO_ROOT, Proc, free_port

MODEL = "bench"
REPLICAS = 4

# --- the engine, in one table -------------------------------------------------------------------
BLOCK_SIZE = 16  # tokens per KV block (vLLM's default)
KV_BLOCKS = 513  # KV capacity per replica: 512 usable blocks (8,192 tokens) and the null block
MAX_MODEL_LEN = 8_192  # what the cache holds (vLLM refuses a longer one for that cache)
PREFILL_TOKENS_PER_S = 10_000.0  # uncached prompt tokens a second, one prefill at a time
DECODE_STEP_MS = 12.0  # one decode step with one sequence running
DECODE_STEP_MS_PER_SEQ = 0.25  # what each further running sequence adds to a step
MAX_NUM_SEQS = 32  # sequences decoded together; the rest wait


@dataclass(frozen=True)
class SimSetting:
    """One flag of ``python -m agents.sim``: passed when the sim's ``--help`` lists it; a
    ``fallback`` one only to a sim without the cache model."""

    flag: str
    value: float | int
    why: str
    fallback: bool = False


def step_ms(running: int) -> float:
    """The decode step with ``running`` sequences, as the table sets it."""
    return DECODE_STEP_MS + DECODE_STEP_MS_PER_SEQ * max(0, running - 1)


SIM_SETTINGS: tuple[SimSetting, ...] = (
    SimSetting("--block-size", BLOCK_SIZE, "tokens per KV block, vLLM's default"),
    SimSetting(
        "--num-gpu-blocks-override",
        KV_BLOCKS,
        "KV capacity: ~5 of the 8 shared prompts when idle, 2-3 beside a full batch",
    ),
    SimSetting("--max-model-len", MAX_MODEL_LEN, "no longer than the cache holds"),
    SimSetting("--max-num-seqs", MAX_NUM_SEQS, "the decode batch; more requests wait"),
    SimSetting(
        "--prefill-tokens-per-s",
        PREFILL_TOKENS_PER_S,
        "an 8B model on one GPU: a 1,500-token miss costs 150 ms",
    ),
    SimSetting("--itl-ms", DECODE_STEP_MS, "a decode step with one sequence running"),
    SimSetting(
        "--itl-ms-per-seq",
        DECODE_STEP_MS_PER_SEQ,
        "the step grows with the batch: 20 ms at 32 sequences",
    ),
    # A sim without a cache: every request pays one shared prompt's miss, then a full batch's
    # steps.
    SimSetting(
        "--ttft-ms",
        round(1_500 / PREFILL_TOKENS_PER_S * 1000),
        "no cache model: a 1,500-token miss",
        fallback=True,
    ),
    SimSetting("--itl-ms", step_ms(MAX_NUM_SEQS), "no cache model: a full batch's step", True),
    SimSetting("--max-concurrency", MAX_NUM_SEQS, "no cache model: the batch", fallback=True),
)
CAPACITY_FLAG = "--num-gpu-blocks-override"  # its presence says the sim models a cache


@dataclass(frozen=True)
class SimKind:
    """The ``sim`` the bench runs: its source folder and the flags it is given."""

    source: Path
    cache_model: bool
    flags: tuple[str, ...]
    missing: tuple[str, ...]  # flags of the table this sim does not have

    def describe(self) -> dict[str, object]:
        return {
            "source": str(self.source),
            "cache_model": self.cache_model,
            "argv": list(self.flags),
            "flags_it_lacks": list(self.missing),
        }


def sim_env(source: Path, env: Mapping[str, str], cache_dir: Path) -> dict[str, str]:
    """The environment of a sim run from ``source``: a foreign source tree is read, never
    written (its bytecode goes to ``cache_dir``)."""
    out = {k: v for k, v in env.items() if not k.startswith(("DJANGO", "DATABASE_URL"))}
    if source.resolve() != REPO_ROOT.resolve():
        out["PYTHONPYCACHEPREFIX"] = str(cache_dir)
    return out


def detect(source: Path, env: Mapping[str, str], cache_dir: Path) -> SimKind:
    """Which flags of the table the sim in ``source`` has (from its ``--help``)."""
    helped = subprocess.run(
        [sys.executable, "-m", "agents.sim", "--help"],
        cwd=source,
        env=sim_env(source, env, cache_dir),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    offered = {word.rstrip(",") for word in helped.split() if word.startswith("--")}
    cache_model = CAPACITY_FLAG in offered
    flags: list[str] = []
    for setting in SIM_SETTINGS:
        # The cache model's rows to a sim with one, the fallback's to one without.
        if setting.fallback != cache_model and setting.flag in offered:
            flags += [setting.flag, format(setting.value, "g")]
    missing = tuple(s.flag for s in SIM_SETTINGS if not s.fallback and s.flag not in offered)
    return SimKind(source, cache_model, tuple(flags), missing)


@dataclass
class Sims:
    """Four fresh replicas: each workload and target gets its own, with empty caches."""

    procs: list[Proc] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [proc.url for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def start_sims(kind: SimKind, env: Mapping[str, str], log_dir: Path, cache_dir: Path) -> Sims:
    sims = Sims()
    environ = sim_env(kind.source, env, cache_dir)
    try:
        for index in range(1, REPLICAS + 1):
            port = free_port()
            argv = [sys.executable, "-m", "agents.sim", "--port", str(port), "--model", MODEL]
            argv += [*kind.flags, "--log-level", "WARNING"]
            proc = Proc(f"sim{index}", argv, log_dir, environ, port=port, cwd=kind.source)
            sims.procs.append(proc.start())
        for proc in sims.procs:
            proc.wait_listening()
    except BaseException:
        sims.stop()
        raise
    return sims


# --- what the engines report ----------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {family: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def counter(samples: Mapping[str, float], name: str) -> float | None:
    """A counter by its family name, exposed with or without ``_total`` (vLLM's client adds
    it; a hand-written exposition may not)."""
    for candidate in (name, name + "_total", name.removesuffix("_total")):
        if candidate in samples:
            return samples[candidate]
    return None


# Requests an engine took: finished, cut by the client, failed (the sim's own counters).
REQUEST_COUNTERS = ("vllm:request_success", "sim:request_cancelled", "sim:request_failed")


@dataclass(frozen=True)
class EngineCounts:
    requests: float
    prefix_queries: float | None  # tokens looked up in the prefix cache
    prefix_hits: float | None  # of those, found cached


def engine_counts(samples: Mapping[str, float]) -> EngineCounts:
    return EngineCounts(
        requests=sum(counter(samples, name) or 0.0 for name in REQUEST_COUNTERS),
        prefix_queries=counter(samples, "vllm:prefix_cache_queries"),
        prefix_hits=counter(samples, "vllm:prefix_cache_hits"),
    )


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        async with session.get(url + "/metrics") as response:
            return parse_metrics(await response.text())

    return list(await asyncio.gather(*(one(url) for url in urls)))


async def sample_waiting(
    session: aiohttp.ClientSession, urls: Sequence[str], peaks: list[float], every: float = 1.0
) -> None:
    """The highest ``vllm:num_requests_waiting`` each engine showed, until cancelled."""
    while True:
        try:
            for index, samples in enumerate(await scrape(session, urls)):
                peaks[index] = max(peaks[index], samples.get("vllm:num_requests_waiting", 0.0))
        except (aiohttp.ClientError, OSError):
            pass  # a missed sample; the next one comes
        await asyncio.sleep(every)


def default_source() -> Path:
    """The sim's source folder: ``BENCH_SIM_SOURCE``, else this repository."""
    return Path(os.environ.get("BENCH_SIM_SOURCE") or REPO_ROOT)
