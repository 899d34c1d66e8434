"""Engine recipes and the pure decisions around them: the command line a shard starts with,
why a shard failed, and how loaded an engine is.

Nothing here starts a process or touches the network, so every rule is tested on plain data.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agents.protocol.messages import DesiredShard
from agents.protocol.vocabulary import MAX_ENGINE_COUNT, Engine, FailureClass


class RecipeError(Exception):
    """The desired shard cannot be turned into a command line (a bad argument template)."""


@dataclass(frozen=True)
class LaunchContext:
    """What only the agent knows: where it binds engines, its interpreter and directories."""

    host: str
    python: str
    weights_dir: Path


@dataclass(frozen=True)
class Launch:
    argv: tuple[str, ...]
    env: Mapping[str, str]


# Each recipe is the engine's OpenAI-compatible server, listening on {host}:{port} and
# answering to the model's API name, and saying in each answer's usage how many prompt tokens
# it found in its prefix cache (``prompt_tokens_details.cached_tokens``): vLLM and SGLang do
# only when asked (--enable-prompt-tokens-details, --enable-cache-report), and routing by the
# cache learns where prefixes are from it, as usage, metrics and the dashboard count cached
# tokens by it (docs/routing.md). The profile's argument template is appended.
_RECIPES: Final[dict[Engine, tuple[str, ...]]] = {
    Engine.SIM: (
        "{python}",
        "-m",
        "agents.sim",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--model",
        "{model}",
    ),
    Engine.VLLM: (
        "{python}",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--model",
        "{source}",
        "--served-model-name",
        "{model}",
        "--enable-prompt-tokens-details",
    ),
    Engine.SGLANG: (
        "{python}",
        "-m",
        "sglang.launch_server",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--model-path",
        "{source}",
        "--served-model-name",
        "{model}",
        "--enable-cache-report",
    ),
    # llama-cpp-python's server (pip install 'llama-cpp-python[server]').
    Engine.LLAMACPP: (
        "{python}",
        "-m",
        "llama_cpp.server",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--model",
        "{source}",
        "--model_alias",
        "{model}",
    ),
}

# llama-cpp-python's server has no /health; a profile left at the generic default would never
# become ready, so its model list (answered once the model is loaded) stands in.
_DEFAULT_HEALTH_PATH: Final = "/health"
_HEALTH_FALLBACK: Final[dict[Engine, str]] = {Engine.LLAMACPP: "/v1/models"}


def health_path(shard: DesiredShard) -> str:
    """Where readiness is polled: the profile's path, or the engine's own where the generic
    default does not exist."""
    if shard.health_path == _DEFAULT_HEALTH_PATH:
        return _HEALTH_FALLBACK.get(shard.engine, _DEFAULT_HEALTH_PATH)
    return shard.health_path


_PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_]+)\}")


def render(template: str, values: Mapping[str, str]) -> str:
    """Fill ``{name}`` placeholders; anything else in braces (JSON, say) is left as written.

    An unknown ``{name}`` is an error rather than a literal: it is almost always a typo in a
    profile, and an engine started with ``{modle}`` in its argv fails in a less clear way.
    """

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            known = ", ".join("{" + k + "}" for k in sorted(values) if k != "python")
            raise RecipeError(f"unknown placeholder {{{name}}} in {template!r}; known: {known}")
        return values[name]

    return _PLACEHOLDER.sub(fill, template)


def resolve_source(source: str, weights_dir: Path) -> str:
    """Where the weights are: an absolute path as given, a name found under the weights
    directory as that path, anything else (a repository id the engine downloads) as given."""
    if source.startswith("/"):
        return source
    candidate = weights_dir / source
    if ".." not in Path(source).parts and candidate.exists():
        return str(candidate)
    return source


def template_values(shard: DesiredShard, ctx: LaunchContext) -> dict[str, str]:
    return {
        "python": ctx.python,
        "host": ctx.host,
        "port": str(shard.port),
        "model": shard.model,
        "source": resolve_source(shard.source, ctx.weights_dir),
        "rank": str(shard.rank),
        "world_size": str(shard.world_size),
        "head_address": shard.head_address,
        "head_port": str(shard.head_port),
        "gpus": ",".join(str(i) for i in shard.gpu_indices),
        "weights_dir": str(ctx.weights_dir),
    }


# What an engine inherits of the agent's environment: the names a GPU server needs (CUDA,
# NCCL, the Hugging Face caches and token, the engines' own settings), and nothing else. The
# agent's own secrets (its node token, a Redis URL, a metrics token, cloud credentials) never
# reach a process that runs a model's code.
_ENV_NAMES: Final = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
        "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
        "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR",
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
        "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    }
)  # fmt: skip
_ENV_PREFIXES: Final = (
    "LC_", "CUDA_", "NCCL_", "NVIDIA_", "CUDNN_", "CUBLAS_", "TORCH", "PYTORCH_", "TRITON_",
    "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "VLLM_", "SGLANG_", "LLAMA_", "GGML_", "ROCM_",
    "HIP_", "UCX_", "GLOO_", "MASTER_",
)  # fmt: skip


def engine_environment(base_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the agent's environment an engine may see (see ``_ENV_NAMES``)."""
    return {k: v for k, v in base_env.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}


# How each engine takes its API key. Through the environment where the engine reads one (the
# process list shows every argv to every user of the machine; /proc/PID/environ only to its
# owner); SGLang reads it only from its command line.
_KEY_ENV: Final[dict[Engine, str]] = {
    Engine.SIM: "VLLM_API_KEY",
    Engine.VLLM: "VLLM_API_KEY",
    Engine.LLAMACPP: "API_KEY",  # llama-cpp-python's server settings
}
_KEY_FLAG: Final[dict[Engine, str]] = {Engine.SGLANG: "--api-key"}


def launch(shard: DesiredShard, ctx: LaunchContext, base_env: Mapping[str, str]) -> Launch:
    """The command line and environment one shard starts with."""
    values = template_values(shard, ctx)
    argv = tuple(render(part, values) for part in (*_RECIPES[shard.engine], *shard.args))
    flag = _KEY_FLAG.get(shard.engine)
    if flag is not None and shard.api_key:
        argv = (*argv, flag, shard.api_key)
    env = engine_environment(base_env)
    if shard.engine is Engine.SIM:
        # sim is part of this package; engines run from the state directory, so the package
        # must be importable from wherever the agent itself was imported.
        path = [str(Path(__file__).resolve().parent.parent), base_env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env.update(
        {
            # The engine sees exactly its own GPUs; an empty list hides all of them, so a
            # CPU-only shard never grabs a device another shard was given.
            "CUDA_VISIBLE_DEVICES": values["gpus"],
            "PYTHONUNBUFFERED": "1",
            "LLMGW_SHARD_ID": str(shard.shard_id),
            "LLMGW_REPLICA_ID": str(shard.replica_id),
            "LLMGW_RANK": str(shard.rank),
            "LLMGW_WORLD_SIZE": str(shard.world_size),
            "LLMGW_HEAD_ADDRESS": shard.head_address,
        }
    )
    env.update({k: render(v, values) for k, v in shard.env.items()})
    key_name = _KEY_ENV.get(shard.engine)
    if key_name is not None:
        if shard.api_key:
            env[key_name] = shard.api_key  # after the profile's env: a profile cannot unset it
        else:
            env.pop(key_name, None)
    return Launch(argv=argv, env=env)


# --------------------------------------------------------------------------- failure classes

# Searched in the last lines of the engine's log, most specific class first. The phrases are
# what PyTorch, CUDA, vLLM, SGLang, llama.cpp, huggingface_hub and argparse actually print.
_OOM: Final = re.compile(
    r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"
    r"|Cannot allocate memory|MemoryError|No available memory for the cache blocks"
    r"|insufficient memory|failed to allocate .*buffer",
    re.IGNORECASE,
)
_DOWNLOAD: Final = re.compile(
    r"RepositoryNotFoundError|GatedRepoError|LocalEntryNotFoundError|EntryNotFoundError"
    r"|HfHubHTTPError|401 Client Error|403 Client Error|404 Client Error"
    r"|Max retries exceeded|Temporary failure in name resolution|couldn't connect to"
    r"|We couldn't connect|Model path does not exist"
    r"|No such file or directory: .*\.(gguf|bin|safetensors)"
    r"|does not appear to have a file named|Failed to load model from file|failed to load model",
    re.IGNORECASE,
)
_BAD_ARGS: Final = re.compile(
    r"error: unrecognized arguments|error: argument |error: the following arguments are required"
    r"|invalid choice:|usage: .*\n?.*error:|ValidationError|invalid value|unknown option"
    # The engine is not installed for this interpreter: a configuration error, not a crash.
    r"|No module named|Error while finding module specification",
    re.IGNORECASE,
)
ARGPARSE_EXIT: Final = 2


def classify_failure(
    exit_code: int | None, log_tail: Sequence[str], *, killed_by_agent: bool = False
) -> FailureClass:
    """Why an engine that should be running is not.

    ``exit_code`` is the process's return code as Python reports it (negative: the signal that
    ended it). A SIGKILL the agent did not send is the kernel's OOM killer in practice.
    """
    text = "\n".join(log_tail)
    if _OOM.search(text) or (exit_code == -9 and not killed_by_agent):
        return FailureClass.OOM
    if _DOWNLOAD.search(text):
        return FailureClass.DOWNLOAD
    if exit_code == ARGPARSE_EXIT or _BAD_ARGS.search(text):
        return FailureClass.BAD_ARGS
    return FailureClass.CRASH


# --------------------------------------------------------------------------- engine load

# (running, waiting) gauges per engine family, as their Prometheus endpoints name them.
_LOAD_METRICS: Final = (
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
)
# How large each engine's KV cache is. vLLM publishes its cache settings as the labels of a
# gauge fixed at 1 (``CacheConfig.metrics_info()``, one series per data-parallel engine):
# ``kv_cache_size_tokens`` where it has it (newer releases: right for hybrid models too),
# else ``num_gpu_blocks`` blocks of ``block_size`` tokens. SGLang publishes the token total
# as a gauge of its own, one series per scheduler.
_VLLM_CACHE: Final = "vllm:cache_config_info"
_SGLANG_CACHE: Final = "sglang:max_total_num_tokens"
# The label that tells one engine's cache from another's within one server: each vLLM
# data-parallel engine and each SGLang data-parallel rank holds a cache of its own (they add
# up); SGLang's tensor- and pipeline-parallel ranks of one data-parallel rank share theirs.
_ENGINE_LABEL: Final = {_VLLM_CACHE: "engine", _SGLANG_CACHE: "dp_rank"}
_SAMPLE: Final = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    # The engine's KV cache capacity in tokens; None where it does not publish it.
    cache_tokens: int | None = None


def parse_load(metrics_text: str) -> EngineLoad | None:
    """Requests running and waiting, summed over every label set (one per served model), and
    the KV cache's capacity; None when the text has neither family's request gauges.

    The text comes from a process the agent does not trust to be sane: a line that is not a
    sample, a value that is not a finite number, is skipped; counts are clamped to what the
    protocol carries, so no engine can make its agent's report malformed.
    """
    sums: dict[str, float] = {}
    caches: dict[tuple[str, str], int] = {}  # (family, engine) -> tokens, the largest seen
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        number = _finite(value)
        if name in _ENGINE_LABEL:
            cache = _cache_tokens(name, _labels(labels or ""), number)
            if cache is not None:
                key = (name, cache[0])
                caches[key] = max(caches.get(key, 0), cache[1])
        elif number is not None:
            sums[name] = sums.get(name, 0.0) + number
    for running, waiting in _LOAD_METRICS:
        if running in sums:
            return EngineLoad(
                _clamp(sums[running]),
                _clamp(sums.get(waiting, 0.0)),
                _clamp(sum(caches.values())) if caches else None,
            )
    return None


def _cache_tokens(name: str, labels: dict[str, str], value: float | None) -> tuple[str, int] | None:
    """One series' (engine, cache tokens), or None when it says no usable size."""
    if name == _VLLM_CACHE:
        tokens = _positive(_finite(labels.get("kv_cache_size_tokens", "")))
        if tokens is None:
            blocks = _positive(_finite(labels.get("num_gpu_blocks", "")))
            size = _positive(_finite(labels.get("block_size", "")))
            tokens = None if blocks is None or size is None else blocks * size
    else:
        tokens = _positive(value)
    if tokens is None:
        return None
    return labels.get(_ENGINE_LABEL[name], ""), min(tokens, MAX_ENGINE_COUNT)


def _labels(text: str) -> dict[str, str]:
    return dict(_LABEL.findall(text))


def _finite(text: str) -> float | None:
    """A sample's value or a label's, as a finite number; None for anything else ("None",
    "NaN", "+Inf", garbage)."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _positive(number: float | None) -> int | None:
    """A size: a whole number of at least one, clamped; None for none or less."""
    if number is None or number < 1:
        return None
    return int(min(number, MAX_ENGINE_COUNT))


def _clamp(number: float) -> int:
    return int(min(max(number, 0.0), MAX_ENGINE_COUNT))


# --------------------------------------------------------------------------- weights


def weights_overlap(a: Path, b: Path) -> bool:
    """Whether removing one path would take files the other uses (same, or one inside)."""
    return a == b or a in b.parents or b in a.parents


def weights_path(name: str, weights_dir: Path) -> Path | None:
    """The path of a weights name inside the weights directory, or None if it would leave it."""
    root = weights_dir.resolve()
    target = (root / name).resolve()
    if target == root or root not in target.parents:
        return None
    return target


def source_path(source: str, weights_dir: Path) -> Path:
    """The path a shard's weights occupy, for the in-use check."""
    resolved = resolve_source(source, weights_dir)
    path = Path(resolved) if resolved.startswith("/") else weights_dir / resolved
    return path.resolve()
