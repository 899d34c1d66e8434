"""What routing by the cache costs per request: CPU of one decision for a 32,000-character prompt.

The request path's routing work, as the relay does it. The decision: the prompt written out and
cut into blocks (``gateway.routing.prefix.blocks_of``), the choice (``Upstreams.choose``: the
mirrors' matches, the host's loads read from the board, whether the prefix is hot,
``gateway.routing.choice.choose_cached``, the blocks then held) and the engine's report learned
(``Placer.learn``). Beside it, the same with the request held at its upstream, as the relay
holds it (``Upstreams.take``, then its first byte and its end counted on the board: the load
accounting that routing reads). Against four upstreams whose mirrors are warm and whose loads
are on a board of the host (every web process has one): eight shared system prompts of ~24,000
characters, each request with a unique ~8,000-character question; and under
``least_outstanding`` (load alone). Run in a process of its own (it needs Django's settings),
in CPU time, the best of a few rounds::

    python -m bench.routing_cost
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_CHARS = 32_000
SYSTEM_CHARS = 24_000
WORDS = [
    "the",
    "engine",
    "keeps",
    "the",
    "cache",
    "of",
    "every",
    "prompt",
    "it",
    "has",
    "seen",
    "so",
    "a",
    "request",
    "whose",
    "long",
    "prefix",
    "is",
    "already",
    "there",
    "skips",
    "that",
    "work",
    "and",
    "answers",
    "sooner",
    "than",
    "one",
    "that",
    "must",
    "compute",
    "it",
    "again",
]


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def measure(requests: int = 5_000, rounds: int = 5) -> dict[str, Any]:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    django.setup()
    from django.test import override_settings

    from gateway.routing import prefix
    from gateway.routing.board import Board
    from gateway.routing.placing import routing_settings
    from gateway.routing.table import Route, Upstream
    from gateway.routing.upstreams import Upstreams

    rng = random.Random(7)
    systems = [_text(rng, SYSTEM_CHARS) for _ in range(8)]
    bodies = [
        {
            "messages": [
                {"role": "system", "content": systems[i % 8]},
                {"role": "user", "content": _text(rng, PROMPT_CHARS - SYSTEM_CHARS)},
            ]
        }
        for i in range(400)
    ]
    route = Route(
        "bench", 1, tuple(Upstream(f"replica:{i}", f"http://10.0.0.{i}:8000") for i in range(4))
    )

    knobs = routing_settings()  # the prompt cut as the relay cuts it (LLMGW_ROUTING_BLOCK_*)

    def one_round(upstreams: Upstreams, cache_aware: bool, hold: bool) -> float:
        """CPU a request: the decision (with ``hold``, the request also held at its upstream,
        its first byte and its end counted, as the relay does)."""
        start = time.process_time()
        for i in range(requests):
            body = bodies[i % len(bodies)]
            blocks = (
                prefix.blocks_of("chat", body, knobs.block_bytes, knobs.max_blocks)
                if cache_aware
                else prefix.NO_BLOCKS
            )
            if hold:
                taken = upstreams.take(route, blocks=blocks, key=blocks.lead)
                assert taken is not None
                choice, held = taken
                upstreams.answered(held)
                upstreams.release(held)
            else:
                chosen = upstreams.choose(route, blocks=blocks)
                assert chosen is not None
                choice = chosen
            if cache_aware:
                upstreams.placer.learn(choice.upstream, blocks, choice.predicted, 6000, 8000)
        return (time.process_time() - start) / requests * 1e6

    out: dict[str, Any] = {
        "prompt_chars": PROMPT_CHARS,
        "requests_per_round": requests,
        "block_bytes": knobs.block_bytes,
    }
    for policy in ("cache_aware", "least_outstanding"):
        with override_settings(LLMGW_ROUTING_POLICY=policy), tempfile.TemporaryDirectory() as var:
            upstreams = Upstreams()
            board = Board.open(Path(var), time.monotonic())
            assert board is not None
            upstreams.loads.share(board)
            upstreams.loads.remember({u.id: 1 for u in route.upstreams}, time.monotonic())
            aware = policy == "cache_aware"
            one_round(upstreams, aware, hold=True)  # warm the mirrors
            out[policy] = {
                "cpu_us_per_request": min(
                    one_round(upstreams, aware, hold=False) for _ in range(rounds)
                ),
                "held_cpu_us_per_request": min(
                    one_round(upstreams, aware, hold=True) for _ in range(rounds)
                ),
            }
            upstreams.loads.unshare()
    out["decision_cpu_us"] = out["cache_aware"]["cpu_us_per_request"]
    out["held_cpu_us"] = out["cache_aware"]["held_cpu_us_per_request"]
    return out


def main() -> None:
    json.dump(measure(), sys.stdout)
    print()


if __name__ == "__main__":
    main()
