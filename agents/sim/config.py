"""The simulator's settings: its command-line flags as one frozen object, checked once, so tests
and benchmarks start the very server the command line does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# vLLM sizes the cache from GPU memory; an 8B model on an 80 GB GPU gets about this many
# blocks of 16 (half a million tokens): room for every test and benchmark that does not ask
# for less, and no memory until blocks are used.
DEFAULT_NUM_GPU_BLOCKS: Final = 32768
DEFAULT_MAX_NUM_SEQS: Final = 256  # vLLM's default for its OpenAI server


@dataclass(frozen=True)
class SimConfig:
    """The command-line flags as data."""

    model: str = "sim-model"
    served_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; read SimServer.port
    max_model_len: int = 32768
    output_tokens: int = 16
    ttft_ms: float = 0.0
    itl_ms: float = 0.0  # a decoding step with one request running
    itl_ms_per_seq: float = 0.0  # what each further running request adds to a step
    prefill_tokens_per_s: float = 0.0  # uncached prompt tokens computed per second; 0: instant
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # running requests; more wait (0: no limit)
    max_concurrency: int = 0  # the older name of max_num_seqs: when set, it wins
    block_size: int = 16
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS  # vLLM's --num-gpu-blocks-override
    enable_prefix_caching: bool = True
    startup_delay: float = 0.0
    embedding_dim: int = 16
    cached_tokens: int | None = None  # report this many cached prompt tokens, whatever hit
    fail_rate: float = 0.0
    fail_status: int = 500
    hang_rate: float = 0.0
    crash_after: int = 0  # 0: never
    seed: int | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    shutdown_grace: float = 5.0
    # As vLLM's --api-key: /v1 (and the fault switch) answer 401 without
    # ``Authorization: Bearer <key>``; health, version and metrics stay open.
    api_key: str = ""
    # The CLI exits the process; an in-process server only drops its connections and stops
    # listening, because exiting would take the test runner down with it.
    exit_on_crash: bool = False
    tokenize: bool = True  # serve vLLM's POST /tokenize

    def __post_init__(self) -> None:
        """Refuse a configuration that would make the simulator lie, naming the flag."""
        problems = [
            f"--{name.replace('_', '-')}={getattr(self, name)!r}"
            for name, bad in (
                ("output_tokens", self.output_tokens < 1),
                ("max_model_len", self.max_model_len < 2),
                ("embedding_dim", not 1 <= self.embedding_dim <= 65536),
                ("max_concurrency", self.max_concurrency < 0),
                ("fail_rate", not 0 <= self.fail_rate <= 1),
                ("hang_rate", not 0 <= self.hang_rate <= 1),
                ("fail_status", not 400 <= self.fail_status <= 599),
                ("crash_after", self.crash_after < 0),
                ("ttft_ms", self.ttft_ms < 0),
                ("itl_ms", self.itl_ms < 0),
                ("startup_delay", self.startup_delay < 0),
                ("cached_tokens", self.cached_tokens is not None and self.cached_tokens < 0),
                ("itl_ms_per_seq", self.itl_ms_per_seq < 0),
                ("prefill_tokens_per_s", self.prefill_tokens_per_s < 0),
                ("max_num_seqs", self.max_num_seqs < 0),
                ("block_size", self.block_size < 1),
            )
            if bad
        ]
        if self.num_gpu_blocks < 2:
            problems.append(f"--num-gpu-blocks-override={self.num_gpu_blocks!r}")
        elif self.block_size >= 1 and self.kv_capacity_tokens < self.max_model_len:
            # vLLM checks this against the memory it profiled; a request of the full length
            # could never be scheduled and would hold up every request behind it.
            problems.append(
                f"--num-gpu-blocks-override={self.num_gpu_blocks} holds "
                f"{self.kv_capacity_tokens} tokens (one block is vLLM's null block), fewer "
                f"than --max-model-len={self.max_model_len}"
            )
        if problems:
            raise ValueError("invalid simulator settings: " + ", ".join(problems))

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    @property
    def seq_limit(self) -> int:
        """Requests that may run at once; 0: no limit."""
        return self.max_concurrency or self.max_num_seqs

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_gpu_blocks - 1) * self.block_size

    @property
    def paced(self) -> bool:
        """Whether requests take time (else each is answered the moment it arrives)."""
        return bool(self.ttft_ms or self.itl_ms or self.itl_ms_per_seq or self.prefill_tokens_per_s)

    @property
    def mode(self) -> str:
        if not self.paced:
            return "instant"
        return (
            f"paced (ttft={self.ttft_ms:g}ms itl={self.itl_ms:g}ms"
            f"+{self.itl_ms_per_seq:g}ms/seq prefill={self.prefill_tokens_per_s:g}tok/s)"
        )
