"""The agent's pure decisions: command lines, failure classes, engine load, backoff, URLs,
simulated GPUs and weights paths. Plain data in, plain data out; no process, no network."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from agents import grpc_wire, links
from agents.agent import Agent, ConnectionConfig, after_stopping_close, backoff_delay, stream_url
from agents.engines import (
    LaunchContext,
    RecipeError,
    classify_failure,
    launch,
    parse_load,
    render,
    resolve_source,
    weights_overlap,
    weights_path,
)
from agents.gpus import parse_simulated
from agents.links import GRPC, WEBSOCKET, GrpcLink, LinkClosed, parse_target
from agents.plan import fingerprint
from agents.protocol.codec import encode
from agents.protocol.messages import DesiredShard, ErrorMessage, Heartbeat
from agents.protocol.vocabulary import (
    MAX_ENGINE_COUNT,
    CloseCode,
    DesiredShardState,
    Engine,
    FailureClass,
)
from tests.harness.procs import connections_to
from tests.harness.waits import await_until

CTX = LaunchContext(host="10.0.0.7", python="/opt/py/bin/python", weights_dir=Path("/srv/w"))
SHARD = DesiredShard(
    shard_id=7,
    replica_id=3,
    generation=1,
    state=DesiredShardState.RUNNING,
    engine=Engine.VLLM,
    model="llama3",
    source="meta-llama/Llama-3-8B",
    port=20001,
    gpu_indices=(2, 3),
)


def test_vllm_recipe_serves_the_source_under_the_model_name_on_the_shard_port() -> None:
    plan = launch(replace(SHARD, args=("--tensor-parallel-size", "{world_size}")), CTX, {})
    assert plan.argv == (
        "/opt/py/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "10.0.0.7",
        "--port",
        "20001",
        "--model",
        "meta-llama/Llama-3-8B",
        "--served-model-name",
        "llama3",
        "--enable-prompt-tokens-details",
        "--tensor-parallel-size",
        "1",
    )
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.parametrize(
    ("engine", "flag"),
    [(Engine.VLLM, "--enable-prompt-tokens-details"), (Engine.SGLANG, "--enable-cache-report")],
)
def test_engines_that_report_cached_tokens_only_when_asked_are_asked(
    engine: Engine, flag: str
) -> None:
    """vLLM and SGLang leave ``prompt_tokens_details.cached_tokens`` out of usage unless
    started with their flag: without it routing by the cache never learns from an engine, and
    every usage row counts no cached tokens."""
    assert flag in launch(replace(SHARD, engine=engine), CTX, {}).argv


@pytest.mark.parametrize(
    ("engine", "module", "source_flag", "name_flag"),
    [
        (Engine.SGLANG, "sglang.launch_server", "--model-path", "--served-model-name"),
        (Engine.LLAMACPP, "llama_cpp.server", "--model", "--model_alias"),
        (Engine.SIM, "agents.sim", "--model", "--model"),
    ],
)
def test_each_engine_has_a_recipe(
    engine: Engine, module: str, source_flag: str, name_flag: str
) -> None:
    argv = launch(replace(SHARD, engine=engine), CTX, {}).argv
    assert argv[:3] == ("/opt/py/bin/python", "-m", module)
    assert argv[argv.index("--port") + 1] == "20001"
    assert argv[argv.index(name_flag) + 1] == "llama3"
    if engine is not Engine.SIM:
        assert argv[argv.index(source_flag) + 1] == "meta-llama/Llama-3-8B"


def test_multi_node_values_fill_the_template() -> None:
    shard = replace(
        SHARD,
        engine=Engine.SGLANG,
        rank=1,
        world_size=2,
        head_address="10.0.0.8",
        head_port=20000,
        args=("--nnodes", "{world_size}", "--node-rank", "{rank}", "--dist-init-addr",
              "{head_address}:{head_port}"),
    )  # fmt: skip
    plan = launch(shard, CTX, {})
    assert plan.argv[-6:] == ("--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
                              "10.0.0.8:20000")  # fmt: skip
    assert (plan.env["LLMGW_RANK"], plan.env["LLMGW_WORLD_SIZE"]) == ("1", "2")


def test_the_node_token_never_reaches_an_engine() -> None:
    base = {"PATH": "/usr/bin", "LLMGW_NODE_TOKEN": "llmgw_node_secret", "HOME": "/root"}
    env = launch(SHARD, CTX, base).env
    assert "LLMGW_NODE_TOKEN" not in env
    assert "llmgw_node_secret" not in " ".join(env.values())
    assert env["PATH"] == "/usr/bin"


def test_a_cpu_only_shard_sees_no_gpu_at_all() -> None:
    assert launch(replace(SHARD, gpu_indices=()), CTX, {}).env["CUDA_VISIBLE_DEVICES"] == ""


def test_profile_env_is_applied_and_templated() -> None:
    env = launch(replace(SHARD, env={"HF_HOME": "{weights_dir}/hf"}), CTX, {}).env
    assert env["HF_HOME"] == "/srv/w/hf"


def test_an_unknown_placeholder_is_an_error_but_json_braces_are_kept() -> None:
    assert render('{"rope": {"type": "x"}}', {"model": "m"}) == '{"rope": {"type": "x"}}'
    with pytest.raises(RecipeError, match=r"unknown placeholder \{modle\}"):
        render("--name={modle}", {"model": "m"})
    with pytest.raises(RecipeError):
        launch(replace(SHARD, args=("{nope}",)), CTX, {})


def test_relative_sources_resolve_under_the_weights_dir_only_when_present(tmp_path: Path) -> None:
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    assert resolve_source("tiny.gguf", tmp_path) == str(tmp_path / "tiny.gguf")
    assert resolve_source("org/remote-model", tmp_path) == "org/remote-model"
    assert resolve_source("/abs/model.gguf", tmp_path) == "/abs/model.gguf"
    assert resolve_source("../tiny.gguf", tmp_path) == "../tiny.gguf"


@pytest.mark.parametrize(
    ("exit_code", "log", "killed", "expected"),
    [
        (1, ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"], False, "oom"),
        (-9, ["loading weights"], False, "oom"),  # the kernel's OOM killer
        (-9, ["loading weights"], True, "crash"),  # our own SIGKILL is no OOM
        (1, ["huggingface_hub.errors.RepositoryNotFoundError: 401 Client Error"], False,
         "download"),
        (1, ["ValueError: Model path does not exist: /srv/w/x.gguf"], False, "download"),
        (2, ["usage: api_server.py [-h]", "error: unrecognized arguments: --bogus"], False,
         "bad_args"),
        (1, ["No module named vllm"], False, "bad_args"),
        (70, ["Traceback (most recent call last):", "RuntimeError: boom"], False, "crash"),
        (0, ["shutting down"], False, "crash"),  # exited while it should run
        (None, [], False, "crash"),
    ],
)  # fmt: skip
def test_failures_are_classified_from_exit_code_and_log(
    exit_code: int | None, log: list[str], killed: bool, expected: str
) -> None:
    assert classify_failure(exit_code, log, killed_by_agent=killed) == FailureClass(expected)


def test_engine_load_is_read_from_vllm_and_sglang_metrics() -> None:
    vllm = (
        "# HELP vllm:num_requests_running Requests in execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a"} 3.0\n'
        'vllm:num_requests_running{model_name="b"} 1.0\n'
        'vllm:num_requests_waiting{model_name="a"} 2.0\n'
    )
    load = parse_load(vllm)
    assert load is not None and (load.running, load.waiting) == (4, 2)
    sglang = "sglang:num_running_reqs 5\nsglang:num_queue_reqs 0\n"
    load = parse_load(sglang)
    assert load is not None and (load.running, load.waiting) == (5, 0)
    assert parse_load("python_gc_objects_collected_total 12\n") is None
    assert parse_load("garbage {{{\n") is None


# ``CacheConfig.metrics_info()`` as vLLM's PrometheusStatLogger writes it (vllm/config/cache.py,
# vllm/v1/metrics/loggers.py): every field as a string label of a gauge fixed at 1, the
# data-parallel engine's index last.
VLLM_CACHE_LABELS = (
    'block_size="16",gpu_memory_utilization="0.9",swap_space="4",cache_dtype="auto",'
    'is_attention_free="False",num_gpu_blocks_override="None",sliding_window="None",'
    'enable_prefix_caching="True",prefix_caching_hash_algo="sha256",cpu_offload_gb="0",'
    'calculate_kv_scales="False",num_gpu_blocks="{blocks}",num_cpu_blocks="None",'
    'engine="{engine}"'
)
VLLM_RUNNING = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="llama",engine="0"} 2.0\n'
    'vllm:num_requests_waiting{model_name="llama",engine="0"} 0.0\n'
)


def vllm_cache(*series: str) -> str:
    return (
        VLLM_RUNNING
        + "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        + "# TYPE vllm:cache_config_info gauge\n"
        + "".join(f"vllm:cache_config_info{{{labels}}} 1.0\n" for labels in series)
    )


def test_a_vllm_engines_cache_is_its_blocks_times_their_size_over_its_engines() -> None:
    one = parse_load(vllm_cache(VLLM_CACHE_LABELS.format(blocks=2048, engine=0)))
    assert one is not None and one.cache_tokens == 2048 * 16
    assert (one.running, one.waiting) == (2, 0)
    # Data parallel: each engine holds a cache of its own.
    two = parse_load(vllm_cache(*(VLLM_CACHE_LABELS.format(blocks=1000, engine=e) for e in (0, 1))))
    assert two is not None and two.cache_tokens == 2 * 1000 * 16


def test_a_vllm_engine_that_says_its_cache_in_tokens_is_taken_at_its_word() -> None:
    """Newer releases add ``kv_cache_size_tokens``: right where blocks times block size is not
    (a hybrid model's requests take blocks in several cache groups)."""
    labels = (
        VLLM_CACHE_LABELS.format(blocks=4000, engine=0)
        + ',mamba_block_size="528",kv_cache_size_tokens="31488",kv_cache_max_concurrency="3.8"'
    )
    load = parse_load(vllm_cache(labels))
    assert load is not None and load.cache_tokens == 31488
    unset = VLLM_CACHE_LABELS.format(blocks=4000, engine=0) + ',kv_cache_size_tokens="None"'
    load = parse_load(vllm_cache(unset))
    assert load is not None and load.cache_tokens == 4000 * 16


def test_an_sglang_engines_cache_counts_each_data_parallel_rank_once() -> None:
    """SGLang's scheduler labels its gauges by rank: tensor- and pipeline-parallel ranks of
    one data-parallel rank share one cache; data-parallel ranks have one each."""

    def sample(tp: int, dp: int | None, tokens: str) -> str:
        rank = "" if dp is None else f',dp_rank="{dp}"'
        return (
            f'sglang:max_total_num_tokens{{model_name="qwen",engine_type="unified",'
            f'tp_rank="{tp}",pp_rank="0"{rank}}} {tokens}\n'
        )

    head = (
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
    )
    load_lines = 'sglang:num_running_reqs{model_name="qwen"} 1.0\nsglang:num_queue_reqs 3.0\n'
    tp = parse_load(head + sample(0, None, "426752.0") + sample(1, None, "426752.0") + load_lines)
    assert tp is not None and tp.cache_tokens == 426752 and (tp.running, tp.waiting) == (1, 3)
    dp = parse_load(head + sample(0, 0, "200000.0") + sample(0, 1, "200000.0") + load_lines)
    assert dp is not None and dp.cache_tokens == 400000
    none_yet = parse_load(head + sample(0, None, "0.0") + load_lines)
    assert none_yet is not None and none_yet.cache_tokens is None


@pytest.mark.parametrize(
    "garbage",
    [
        VLLM_CACHE_LABELS.format(blocks="None", engine=0),  # before profiling
        VLLM_CACHE_LABELS.format(blocks="NaN", engine=0),
        VLLM_CACHE_LABELS.format(blocks="-2048", engine=0),
        VLLM_CACHE_LABELS.format(blocks="+Inf", engine=0),
        VLLM_CACHE_LABELS.format(blocks="2048", engine=0).replace('"16"', '"sixteen"'),
        'engine="0"',
        'block_size="16",num_gpu_blocks="20',  # cut short
    ],
)
def test_a_cache_size_that_is_not_a_number_is_no_size_and_stops_nothing(garbage: str) -> None:
    load = parse_load(vllm_cache(garbage))
    assert load is not None and load.cache_tokens is None
    assert (load.running, load.waiting) == (2, 0)


def test_absurd_engine_numbers_are_clamped_to_what_the_protocol_carries() -> None:
    huge = parse_load(vllm_cache(VLLM_CACHE_LABELS.format(blocks="1e30", engine=0)))
    assert huge is not None and huge.cache_tokens == MAX_ENGINE_COUNT
    many = parse_load(
        vllm_cache(*(VLLM_CACHE_LABELS.format(blocks=2**30, engine=e) for e in range(4)))
    )
    assert many is not None and many.cache_tokens == MAX_ENGINE_COUNT
    odd = parse_load(
        'vllm:num_requests_running{model_name="a"} 1e30\n'
        'vllm:num_requests_running{model_name="b"} NaN\n'
        'vllm:num_requests_waiting{model_name="a\\"b"} -4\n'
        "vllm:num_requests_waiting +Inf\n"
        "sglang:max_total_num_tokens 1e400\n"
    )
    assert odd is not None
    assert (odd.running, odd.waiting, odd.cache_tokens) == (MAX_ENGINE_COUNT, 0, None)


def test_backoff_doubles_up_to_the_cap_with_jitter_in_the_upper_half() -> None:
    low = [backoff_delay(n, base=0.5, cap=30, rand=lambda: 0.0) for n in range(10)]
    high = [backoff_delay(n, base=0.5, cap=30, rand=lambda: 1.0) for n in range(10)]
    assert low[:4] == [0.25, 0.5, 1.0, 2.0]
    assert high[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(high) == 30 and max(low) == 15
    assert backoff_delay(10**6, base=0.5, cap=30, rand=lambda: 0.5) == 22.5


def test_a_stopping_control_plane_is_left_at_once_but_a_refusal_backs_off() -> None:
    """1012 (a web process draining) and 1001 (going away) say "reconnect now, elsewhere";
    every other close, or none, is a failure the backoff paces."""
    assert after_stopping_close(1012) and after_stopping_close(1001)
    for code in (None, 1000, 1006, 4401, 4409, 4503):
        assert not after_stopping_close(code)


class _RefusesHello:
    """A control plane's end of a stream that answers hello with 4429: this node opened more
    streams than the control plane takes in its window."""

    close_code = int(CloseCode.RATE_LIMITED)
    close_reason = ""

    async def send(self, text: str) -> None:
        pass

    async def recv(self) -> str:
        return encode(
            ErrorMessage(
                CloseCode.RATE_LIMITED,
                "more than 20 streams of node 'n1' within 60s; reconnect in 42s",
            )
        )

    async def close(self, code: int, reason: str) -> None:
        pass

    def local_address(self) -> str | None:
        return None


async def test_an_agent_refused_for_reconnecting_too_often_waits_half_its_backoff_cap() -> None:
    """4429 says "slow down": the agent does not come back after the short first steps of its
    backoff (a node refused for its reconnects would keep adding to its count) but after the
    cap's wait, jitter included (here with no jitter at all: its lower bound)."""
    config = ConnectionConfig(
        urls=("ws://127.0.0.1:1",), token="t", node="n1", backoff_base=0.01, backoff_max=0.4
    )
    supervisor = SimpleNamespace(gpus=SimpleNamespace(read=lambda: ()), highest_epoch=0)
    agent = Agent(config, supervisor, rand=lambda: 0.0)  # type: ignore[arg-type]
    opened: list[float] = []
    stop = asyncio.Event()

    @contextlib.asynccontextmanager
    async def refusing(target: links.Target) -> AsyncIterator[_RefusesHello]:
        opened.append(time.monotonic())
        if len(opened) == 3:
            stop.set()
        yield _RefusesHello()

    agent._open = refusing  # type: ignore[method-assign]
    # A generous guard against hanging the suite, not a measure: the run takes under a second.
    await asyncio.wait_for(agent.run(stop), timeout=60)
    gaps = [later - earlier for earlier, later in itertools.pairwise(opened)]
    assert len(gaps) == 2 and min(gaps) >= 0.2, gaps


def test_two_agents_do_not_retry_in_lock_step() -> None:
    import random

    first, second = random.Random(1), random.Random(2)
    a = [backoff_delay(3, base=0.5, cap=30, rand=first.random) for _ in range(5)]
    b = [backoff_delay(3, base=0.5, cap=30, rand=second.random) for _ in range(5)]
    assert a != b
    assert all(2.0 <= d <= 4.0 for d in a + b)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://cp:8000", "ws://cp:8000/agents/stream"),
        ("https://cp.example/", "wss://cp.example/agents/stream"),
        ("ws://cp:8000/agents/stream", "ws://cp:8000/agents/stream"),
        ("wss://cp/custom/path", "wss://cp/custom/path"),
    ],
)
def test_control_plane_urls_may_be_given_as_web_addresses(given: str, expected: str) -> None:
    assert stream_url(given) == expected


@pytest.mark.parametrize("bad", ["ftp://cp", "cp:8000", "http://"])
def test_a_control_plane_url_that_is_no_url_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not an http"):
        stream_url(bad)


def test_simulated_gpus_are_parsed_from_a_short_spec() -> None:
    gpus = parse_simulated("2x80GiB,1x24GiB", "n1")
    assert [(g.index, g.memory_total_mib) for g in gpus] == [(0, 81920), (1, 81920), (2, 24576)]
    assert gpus[0].uuid == "SIM-n1-0" and gpus[2].uuid == "SIM-n1-2"
    assert parse_simulated("1x512MiB", "n")[0].memory_total_mib == 512
    for bad in ("2", "x80GiB", "0x80GiB", "2x80TB", "99x1GiB"):
        with pytest.raises(ValueError, match="--simulate-gpus"):
            parse_simulated(bad, "n")


def test_weights_paths_never_leave_the_weights_directory(tmp_path: Path) -> None:
    assert weights_path("org/model", tmp_path) == tmp_path.resolve() / "org" / "model"
    assert weights_path("../outside", tmp_path) is None
    assert weights_path(".", tmp_path) is None
    (tmp_path / "link").symlink_to("/etc")
    assert weights_path("link/passwd", tmp_path) is None  # a symlink out is still out


def test_weights_overlap_when_one_path_holds_the_other() -> None:
    root = Path("/w")
    assert weights_overlap(root / "org", root / "org" / "model")
    assert weights_overlap(root / "org" / "model", root / "org")
    assert weights_overlap(root / "a", root / "a")
    assert not weights_overlap(root / "org" / "a", root / "org" / "b")


def test_a_shard_restarts_only_when_what_it_runs_changes() -> None:
    base = fingerprint(SHARD)
    assert fingerprint(replace(SHARD, startup_timeout_s=5)) == base
    assert fingerprint(replace(SHARD, state=DesiredShardState.DRAINING)) == base
    assert fingerprint(replace(SHARD, generation=2)) != base
    assert fingerprint(replace(SHARD, args=("--x",))) != base
    assert fingerprint(replace(SHARD, gpu_indices=(0,))) != base


def test_without_nvml_the_fallback_gpus_are_simulated() -> None:
    import importlib.util

    from agents.gpus import discover

    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("NVML is installed here; this checks the machines without it")
    assert [g.memory_total_mib for g in discover(None, "n", fallback="2x8GiB").read()] == [
        8192,
        8192,
    ]
    assert discover(None, "n").read() == ()
    assert len(discover("3x1GiB", "n", fallback="2x8GiB").read()) == 3  # asked for wins


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        ([], {}, "no node token: pass --token-file or set LLMGW_NODE_TOKEN"),
        ([], {"LLMGW_NODE_TOKEN": "sk-not-a-node-token"}, "does not start with 'llmgw_node_'"),
        (["--token-file", "/nonexistent/token"], {}, "cannot read --token-file"),
        (["--control-plane", "ftp://cp"], {"LLMGW_NODE_TOKEN": "llmgw_node_x"}, "is not an http"),
        (["--simulate-gpus", "lots"], {}, "expected COUNTxSIZE like 2x80GiB"),
        (["--port-range", "9-1"], {}, "ports must be 1-65535, low <= high"),
        (["--node", "bad name!"], {}, "use 1-100 letters, digits"),
    ],
)
def test_the_agent_refuses_bad_configuration_at_start(
    tmp_path: Path, args: list[str], env: dict[str, str], words: str
) -> None:
    import subprocess
    import sys

    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}
    result = subprocess.run(
        [sys.executable, "-m", "agents", "--state-dir", str(tmp_path / "s"),
         "--weights-dir", str(tmp_path / "w"), *args],
        env=base, capture_output=True, text=True, timeout=30, check=False,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 2
    assert words in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- where engines run


SECRETS = {
    "LLMGW_NODE_TOKEN": "llmgw_node_secret",
    "REDIS_URL": "redis://:hunter2@cache:6379/0",
    "LLMGW_METRICS_TOKEN": "metrics-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "AWS_ACCESS_KEY_ID": "AKIA-secret",
    "GOOGLE_APPLICATION_CREDENTIALS": "/etc/gcp.json",
    "DATABASE_URL": "postgres://u:p@db/x",
}


def test_engines_get_an_allowlisted_environment_never_the_agents_secrets() -> None:
    base = {
        **SECRETS,
        "PATH": "/usr/bin",
        "HOME": "/root",
        "HF_TOKEN": "hf_x",
        "NCCL_DEBUG": "INFO",
        "CUDA_HOME": "/usr/local/cuda",
        "LC_ALL": "C.UTF-8",
    }
    env = launch(SHARD, CTX, base).env
    assert not set(SECRETS) & set(env)
    joined = " ".join(env.values())
    assert not any(secret in joined for secret in SECRETS.values())
    for kept in ("PATH", "HOME", "HF_TOKEN", "NCCL_DEBUG", "CUDA_HOME", "LC_ALL"):
        assert env[kept] == base[kept]


@pytest.mark.parametrize(
    ("engine", "where"),
    [
        (Engine.SIM, ("env", "VLLM_API_KEY")),
        (Engine.VLLM, ("env", "VLLM_API_KEY")),
        (Engine.LLAMACPP, ("env", "API_KEY")),
        (Engine.SGLANG, ("argv", "--api-key")),
    ],
)
def test_each_engine_is_given_its_replicas_key_the_way_it_reads_one(
    engine: Engine, where: tuple[str, str]
) -> None:
    shard = replace(SHARD, engine=engine, api_key="llmgw_engine_k")
    plan = launch(shard, CTX, {"VLLM_API_KEY": "agent's own"})
    kind, name = where
    if kind == "env":
        assert plan.env[name] == "llmgw_engine_k"
        assert "llmgw_engine_k" not in plan.argv  # not in the process list
    else:
        assert plan.argv[plan.argv.index(name) + 1] == "llmgw_engine_k"
    # A profile cannot switch the key off through its env.
    profiled = launch(replace(shard, env={"VLLM_API_KEY": "", "API_KEY": ""}), CTX, {})
    if kind == "env":
        assert profiled.env[name] == "llmgw_engine_k"


@pytest.mark.parametrize(
    "url",
    ["ws://10.0.0.5:8000", "http://cp.example:8000", "grpc://10.0.0.5:9000"],
)
def test_a_control_plane_without_tls_off_loopback_is_refused(url: str) -> None:
    transport = GRPC if "grpc" in url else WEBSOCKET
    with pytest.raises(ValueError, match="has no TLS"):
        parse_target(url, transport)
    assert not parse_target(url, transport, insecure=True).tls  # the operator's choice


@pytest.mark.parametrize(
    ("url", "transport", "expected"),
    [
        ("http://127.0.0.1:8000", WEBSOCKET, "ws://127.0.0.1:8000/agents/stream"),
        ("https://cp.example", WEBSOCKET, "wss://cp.example/agents/stream"),
        ("http://localhost:9000", GRPC, "grpc://localhost:9000"),
        ("https://cp.example:9443", GRPC, "grpcs://cp.example:9443"),
        ("grpcs://[::1]:9443", GRPC, "grpcs://[::1]:9443"),
    ],
)
def test_loopback_and_tls_urls_are_accepted(url: str, transport: str, expected: str) -> None:
    assert parse_target(url, transport).url == expected


def test_a_grpc_url_needs_the_listeners_port() -> None:
    with pytest.raises(ValueError, match="port"):
        parse_target("grpcs://cp.example", GRPC)


def _plan(tmp_path: Path, *args: str) -> Any:
    from agents.__main__ import build_parser, prepare

    token = tmp_path / "token"
    token.write_text("llmgw_node_" + "x" * 43)
    token.chmod(0o600)
    argv = ["--token-file", str(token), "--state-dir", str(tmp_path / "s")]
    argv += ["--weights-dir", str(tmp_path / "w"), *args]
    return prepare(build_parser().parse_args(argv))


def test_engines_bind_the_address_the_node_is_reached_at_never_every_interface(
    tmp_path: Path,
) -> None:
    """No --advertise-address: the node advertises the address it reaches the control plane
    from (loopback for a local one), and its engines listen there only."""
    plan = _plan(tmp_path, "--control-plane", "http://127.0.0.1:8000")
    assert plan.connection.addresses == ("127.0.0.1",)
    assert plan.supervisor.launch.host == "127.0.0.1"
    given = _plan(tmp_path, "--control-plane", "http://127.0.0.1:8000", "--advertise-address",
                  "10.1.2.3")  # fmt: skip
    assert given.supervisor.launch.host == "10.1.2.3"


def test_over_grpc_a_client_certificate_replaces_the_token(tmp_path: Path) -> None:
    from agents.__main__ import build_parser, prepare

    for name in ("ca.pem", "n1.pem", "n1.key"):
        (tmp_path / name).write_text("-----BEGIN-----\n")
    args = build_parser().parse_args(
        [
            "--transport", "grpc", "--control-plane", "grpcs://cp.example:9443",
            "--tls-ca", str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "n1.pem"),
            "--tls-key", str(tmp_path / "n1.key"), "--advertise-address", "10.1.2.3",
            "--state-dir", str(tmp_path / "s"), "--weights-dir", str(tmp_path / "w"),
        ]
    )  # fmt: skip
    plan = prepare(args)
    assert plan.connection.token == ""
    assert plan.connection.urls == ("grpcs://cp.example:9443",)
    args.tls_key = None
    with pytest.raises(ValueError, match="go together"):
        prepare(args)


async def test_wss_verifies_the_control_plane_by_the_cluster_ca(tmp_path: Path) -> None:
    """``wss://`` with ``--tls-ca``: the control plane's certificate must chain to the
    cluster CA (a server with another CA's certificate is not talked to)."""
    import ssl

    from websockets.asyncio.server import serve

    from agents.links import TlsFiles
    from control.node_certs import init_ca  # writes files only; no store needed

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    init_ca(ours, ["localhost", "127.0.0.1"])
    init_ca(theirs, ["localhost", "127.0.0.1"])

    async def echo(ws: Any) -> None:
        async for message in ws:
            await ws.send(message)

    for served_by, works in ((ours, True), (theirs, False)):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(served_by / "server.pem", served_by / "server.key")
        async with serve(echo, "127.0.0.1", 0, ssl=context) as server:
            port = server.sockets[0].getsockname()[1]
            config = ConnectionConfig(
                urls=(f"wss://127.0.0.1:{port}",),
                token="llmgw_node_x",
                node="n1",
                tls=TlsFiles(ca=ours / "ca.pem"),
            )
            agent = Agent(config, supervisor=None)  # type: ignore[arg-type]
            if works:
                async with agent._open(agent.targets[0]) as link:
                    await link.send("ping")
                    assert await link.recv() == "ping"
            else:
                with pytest.raises(ssl.SSLCertVerificationError):
                    async with agent._open(agent.targets[0]):
                        pass


async def test_an_agent_leaves_a_stopping_control_plane_that_never_ends_the_stream() -> None:
    """ "This control plane is stopping" ends the stream on the agent's side as well: a control
    plane that says so and then never ends the call (stuck in its stop) must not hold the agent,
    which would wait on that stream forever instead of reconnecting."""
    goodbye = encode(ErrorMessage(CloseCode.SERVICE_RESTART, "this control plane is stopping"))
    closed: list[int] = []

    class SaysGoodbyeThenNothing:
        def __init__(self) -> None:
            self.frames = [goodbye]

        async def recv(self) -> str:
            if self.frames:
                return self.frames.pop(0)
            await asyncio.Event().wait()  # the stream is never ended
            raise AssertionError("unreachable")

        async def send(self, text: str) -> None:
            pass

        async def close(self, code: int, reason: str) -> None:
            closed.append(code)

    config = ConnectionConfig(urls=("ws://127.0.0.1:1",), token="t", node="n1")
    agent = Agent(config, supervisor=None)  # type: ignore[arg-type]
    # A generous guard against hanging the suite, not a measure: the call returns at once.
    await asyncio.wait_for(agent._receive(SaysGoodbyeThenNothing()), timeout=60)  # type: ignore[arg-type]
    assert closed == [CloseCode.SERVICE_RESTART]


class _DeadCall:
    """A grpc.aio stream call on a connection that is gone, as seen under load: no operation
    on it ever completes, and none fails either."""

    def __init__(self) -> None:
        self.cancelled = False

    async def _never(self) -> Any:
        await asyncio.Event().wait()

    def read(self) -> Any:
        return self._never()

    def write(self, _frame: Any) -> Any:
        return self._never()

    def done_writing(self) -> Any:
        return self._never()

    def trailing_metadata(self) -> Any:
        return self._never()

    def details(self) -> Any:
        return self._never()

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _DeadChannel:
    def close(self, grace: float | None = None) -> Any:
        return asyncio.Event().wait()


async def test_a_grpc_stream_whose_operations_never_complete_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write that does not complete ends the link (the agent then reconnects), and closing
    the link returns though neither the half-close nor the channel's close ever completes."""
    monkeypatch.setattr(links, "CLOSE_TIMEOUT_S", 0.1)
    call = _DeadCall()
    link = GrpcLink(_DeadChannel(), call, write_timeout=0.2)
    heartbeat = encode(Heartbeat(seq=1))
    # Generous guards against hanging the suite, not measures.
    with pytest.raises(LinkClosed, match="did not complete"):
        await asyncio.wait_for(link.send(heartbeat), timeout=60)
    await asyncio.wait_for(link.close(CloseCode.SERVICE_RESTART, "stopping"), timeout=60)
    assert call.cancelled
    assert link.close_code == CloseCode.SERVICE_RESTART
    with pytest.raises(LinkClosed, match="closing"):
        await asyncio.wait_for(link.send(heartbeat), timeout=60)


async def test_a_link_the_control_plane_ended_leaves_no_connection_even_without_a_gc_pass() -> None:
    """The control plane ends the stream (a revoked certificate), the agent closes its link and
    sleeps out a long backoff, allocating nothing, so no garbage collection runs: the TCP
    connection must be gone all the same. grpc.aio tears a channel's connection down only once
    its last call object is freed, and the link's reference cycles held the call."""

    async def revoked(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "node credentials refused")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                grpc_wire.SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(revoked)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gc.disable()
    try:
        link = await links.open_grpc(
            parse_target(f"grpc://127.0.0.1:{port}", GRPC),
            links.TlsFiles(),
            (),
            open_timeout=60,
            keepalive_s=30,
            max_message_bytes=1 << 20,
            write_timeout=60,
        )
        # The agent's first frame; the control plane may have ended the call before it.
        with contextlib.suppress(LinkClosed):
            await link.send(encode(Heartbeat(seq=1)))
        with pytest.raises(links.Refused):
            await asyncio.wait_for(link.recv(), timeout=60)
        assert connections_to(os.getpid(), port)
        await link.close(1000, "")
        await await_until(lambda: not connections_to(os.getpid(), port), what="no connection")
    finally:
        gc.enable()
        await server.stop(None)
