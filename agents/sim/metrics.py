"""``GET /metrics``: the simulator's counters and gauges in Prometheus' text format, under the
names and types vLLM's ``PrometheusStatLogger`` gives them (``vllm/v1/metrics/loggers.py``) as
``prometheus_client`` writes them: a counter ``vllm:x`` is exposed as ``vllm:x_total``, and
``vllm:cache_config_info`` is a gauge fixed at 1 whose labels are the cache settings (a router
or an agent learns ``block_size`` and ``num_gpu_blocks``, the capacity, from it).

vLLM labels its series ``model_name`` and ``engine``; the simulator gives ``model_name`` only,
as it always has. The token and request counters add up exactly what the usage objects of
successful requests reported; the prefix-cache counters count every request's first cache
lookup (``cached_tokens`` as reported), as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.sim.config import SimConfig
from agents.sim.scheduler import Scheduler


@dataclass
class SimStats:
    """The counters behind ``/metrics`` that the server keeps, for in-process assertions."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=dict)  # by finish reason
    cancelled: int = 0
    failed: int = 0
    inference_requests: int = 0


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def cache_config_labels(config: SimConfig) -> str:
    """vLLM's ``CacheConfig.metrics_info()``: its fields as strings, in field order, and the
    engine's index."""
    fields = {
        "block_size": config.block_size,
        "gpu_memory_utilization": 0.9,
        "swap_space": 4,
        "cache_dtype": "auto",
        "is_attention_free": False,
        "num_gpu_blocks_override": config.num_gpu_blocks,
        "sliding_window": None,
        "enable_prefix_caching": config.enable_prefix_caching,
        # Python's own hash: vLLM's name for it before 0.11 dropped the option.
        "prefix_caching_hash_algo": "builtin",
        "cpu_offload_gb": 0,
        "calculate_kv_scales": False,
        "num_gpu_blocks": config.num_gpu_blocks,
        "num_cpu_blocks": 0,
        "engine": 0,
    }
    return ",".join(f'{k}="{_label(str(v))}"' for k, v in fields.items())


def render(config: SimConfig, stats: SimStats, scheduler: Scheduler) -> bytes:
    """The whole ``/metrics`` body."""
    label = f'model_name="{_label(config.names[0])}"'
    usage = scheduler.pool.usage
    reasons = {"stop": 0, "length": 0, **stats.success}
    families: list[tuple[str, str, str, list[tuple[str, float]]]] = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
         [(label, scheduler.num_running)]),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
         [(label, scheduler.num_waiting)]),
        ("vllm:gpu_cache_usage_perc", "gauge",
         "GPU KV-cache usage. 1 means 100 percent usage."
         "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
         [(label, usage)]),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         [(label, usage)]),
        ("vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.",
         [(label, scheduler.queries)]),
        ("vllm:prefix_cache_hits_total", "counter",
         "Prefix cache hits, in terms of number of cached tokens.",
         [(label, scheduler.hits)]),
        ("vllm:num_preemptions_total", "counter",
         "Cumulative number of preemption from the engine.",
         [(label, scheduler.preemptions)]),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         [(label, stats.prompt_tokens)]),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         [(label, stats.generation_tokens)]),
        ("vllm:request_success_total", "counter", "Count of successfully processed requests.",
         [(f'finished_reason="{r}",{label}', n) for r, n in sorted(reasons.items())]),
        ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
         [(cache_config_labels(config), 1)]),
        ("sim:request_cancelled_total", "counter", "Requests whose client went away first.",
         [(label, stats.cancelled)]),
        ("sim:request_failed_total", "counter", "Requests failed by fault injection.",
         [(label, stats.failed)]),
    ]  # fmt: skip
    lines = []
    for name, kind, doc, samples in families:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{labels}}} {float(value)!r}" for labels, value in samples]
    return ("\n".join(lines) + "\n").encode()
