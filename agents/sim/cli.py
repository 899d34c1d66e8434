"""``python -m agents.sim``: the simulator as a process, the way the node agent starts engines."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from agents.sim.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_GPU_BLOCKS, SimConfig
from agents.sim.engine import serve

log = logging.getLogger("agents.sim")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m agents.sim", description="A simulated vLLM OpenAI-compatible server."
    )
    add = parser.add_argument
    add("--model", default="sim-model", help="the model id, as vLLM's --model")
    add("--served-model-name", nargs="+", default=[], help="names clients may ask for")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000, help="0 picks a free port (logged at start)")
    add("--max-model-len", type=int, default=32768)
    add("--output-tokens", type=int, default=16, help="tokens generated without max_tokens")
    add("--ttft-ms", type=float, default=0.0, help="time to first token, after the prefill")
    add("--itl-ms", type=float, default=0.0, help="gap between tokens with one request running")
    add("--itl-ms-per-seq", type=float, default=0.0, help="added per other running request")
    add("--prefill-tokens-per-s", type=float, default=0.0, help="1 prefill at a time; 0: instant")
    add("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="running; 0: no limit")
    add("--max-concurrency", type=int, default=0, help="the older name of --max-num-seqs")
    add("--block-size", type=int, default=16, help="tokens per KV cache block")
    add("--num-gpu-blocks-override", "--kv-blocks", type=int, default=DEFAULT_NUM_GPU_BLOCKS)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    # vLLM's switch for usage.prompt_tokens_details, which the simulator always reports.
    add("--enable-prompt-tokens-details", action="store_true", help="always on")
    add("--startup-delay", type=float, default=0.0, help="seconds of 503 before ready")
    add("--embedding-dim", type=int, default=16)
    add("--cached-tokens", type=int, default=None, help="report this many cached, whatever hit")
    add("--fail-rate", type=float, default=0.0, help="share of requests that fail")
    add("--fail-status", type=int, default=500, help="the status they fail with")
    add("--hang-rate", type=float, default=0.0, help="share of requests that never answer")
    add("--crash-after", type=int, default=0, help="exit non-zero on request N+1 (0: never)")
    add("--seed", type=int, default=None, help="seed for the fail and hang draws")
    add("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    add("--shutdown-grace", type=float, default=5.0, help="seconds in-flight requests get")
    add(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY", ""),
        help="refuse /v1 calls without this bearer key, as vLLM does (default: VLLM_API_KEY; "
        "the environment keeps it out of the process list)",
    )
    add("--no-tokenize", action="store_true", help="no POST /tokenize (an engine without one)")
    add("--log-level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        served_model_names=tuple(args.served_model_name),
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        output_tokens=args.output_tokens,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        itl_ms_per_seq=args.itl_ms_per_seq,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        max_num_seqs=args.max_num_seqs,
        max_concurrency=args.max_concurrency,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        startup_delay=args.startup_delay,
        embedding_dim=args.embedding_dim,
        cached_tokens=args.cached_tokens,
        fail_rate=args.fail_rate,
        fail_status=args.fail_status,
        hang_rate=args.hang_rate,
        crash_after=args.crash_after,
        seed=args.seed,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace=args.shutdown_grace,
        api_key=args.api_key,
        exit_on_crash=True,
        tokenize=not args.no_tokenize,
    )


async def _run(config: SimConfig) -> int:
    server = await serve(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("sim stopping: in-flight requests get %gs", config.shutdown_grace)
    await server.close()
    log.info("sim stopped")
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it happens to be installed; it is not a dependency."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, ignored = parser.parse_known_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if ignored:
        # A profile written for vLLM passes vLLM's flags (--tensor-parallel-size ...); the
        # simulator has no use for them and must not refuse to start because of them.
        log.warning("sim: ignoring arguments %s", " ".join(ignored))
    try:
        config = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_run(config))
