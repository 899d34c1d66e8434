"""The routing bench's engines and workloads in virtual time: how the routing choice itself fares,
in seconds, with no machine's noise in it.

``make bench-routing`` runs real processes on one machine: four ``sim`` engines, the routers, the
load generator, all sharing two cores, so every figure carries that machine's scheduling noise,
and a run takes minutes. This runs the same four engines -- the sim's own scheduler and block
pool (``agents.sim``), configured from the bench's table (``bench/routing/sims.py``), stepped as
its server steps them -- under the bench's own workloads (``bench/routing/workloads.py``), on an
event loop whose clock jumps to the next timer instead of waiting for it. In front of them:

- ``llmgw``: the gateway's routing as its web processes run it (``gateway.routing``: prompt
  blocks, mirrors, loads, hot prefixes, the choice, learning from each answer's
  ``cached_tokens``), as one process, which sees the host's counts as the board shows them;
- ``least-outstanding`` and ``round-robin``, for scale.

What it leaves out: the time a router and the HTTP hops take, and a second web process (the
board makes the host's processes see what one process sees; the homes keep them from placing a
new prefix twice). And its clock is regular as no machine is: least-outstanding keeps a chat's
turns on one engine here by the rhythm of the turns alone, which it does not on real processes.
So it answers "does this choice route well?", not "how fast is llmgw?": a change of routing is
tried here in seconds, then measured in ``make bench-routing``.

    python -m bench.routing.model [--workload NAME ...] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import selectors
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench import percentile
from bench.routing import sims
from bench.routing.workloads import (
    FULL,
    MORE_WORKLOADS,
    QUICK,
    WORKLOADS,
    Message,
    Outcome,
    Run,
    Size,
)


class _JumpingSelector(selectors.DefaultSelector):
    """Waits for nothing: a wait for the next timer moves the loop's clock there at once."""

    def __init__(self, loop: VirtualLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is not None and timeout > 0:
            self._loop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on a clock of its own that only timers move (no I/O is done on it)."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def engine_config() -> Any:
    """The bench's engine (``bench/routing/sims.py``'s table), as the sim's command line would
    configure it."""
    from agents.sim.cli import build_parser, config_from_args

    flags = [str(v) for s in sims.SIM_SETTINGS if not s.fallback for v in (s.flag, s.value)]
    args = build_parser().parse_args([*flags, "--model", sims.MODEL])
    return config_from_args(args)


class Engine:
    """One engine: the sim's server, its requests scheduled and stepped by its own code."""

    def __init__(self, config: Any, loop: VirtualLoop) -> None:
        from agents.sim.engine import SimServer

        self.server = SimServer(config)
        self.server.scheduler.clock = loop.time
        self.job = types.SimpleNamespace(ttft=config.ttft_ms / 1000, itl=config.itl_ms / 1000)
        self.requests = 0
        self.peak_waiting = 0

    async def generate(
        self, messages: list[Message], max_tokens: int, first: Callable[[], None]
    ) -> tuple[int, int]:
        """Run one chat to its last token; ``first`` is called at its first. Its prompt
        tokens and the cached ones, as its usage would say."""
        from agents.sim.prompts import TEMPLATE_ROOT, chat_tokens
        from agents.sim.scheduler import work_for

        scheduler = self.server.scheduler
        prompt = chat_tokens(messages, None)
        work = work_for([prompt], None, TEMPLATE_ROOT)
        self.requests += 1
        try:
            await scheduler.admit(work)
            self.peak_waiting = max(self.peak_waiting, scheduler.num_waiting)
            for token in range(1, max_tokens + 1):
                # The server's own stepping: the first token after the prefill, each next one a
                # decoding step later, longer with more running; a preempted one waits again.
                await self.server._step(work, self.job, token)  # type: ignore[arg-type]
                if token == 1:
                    first()
        finally:
            scheduler.release(work)
        return len(prompt), work.cached


class Router:
    """Sends a chat to one of the engines and reads what came back, as a client would."""

    def __init__(self, engines: Sequence[Engine], loop: VirtualLoop) -> None:
        self.engines = engines
        self.loop = loop

    def pick(self, messages: list[Message]) -> tuple[int, Any]:
        raise NotImplementedError

    def started(self, index: int, context: Any) -> Any:
        return None

    def first_token(self, index: int, context: Any, held: Any) -> None:
        pass

    def ended(self, index: int, context: Any, held: Any, prompt: int, cached: int) -> None:
        pass

    async def send(self, messages: list[Message], max_tokens: int) -> Outcome:
        from agents.sim.wire import generated_text

        sent = self.loop.time()
        index, context = self.pick(messages)
        held = self.started(index, context)
        ttft = 0.0

        def first() -> None:
            nonlocal ttft
            ttft = self.loop.time() - sent
            self.first_token(index, context, held)

        prompt, cached = await self.engines[index].generate(messages, max_tokens, first)
        self.ended(index, context, held, prompt, cached)
        return Outcome(True, ttft, prompt, cached, max_tokens, generated_text(max_tokens))


class RoundRobin(Router):
    def __init__(self, engines: Sequence[Engine], loop: VirtualLoop) -> None:
        super().__init__(engines, loop)
        self._turn = itertools.count()

    def pick(self, messages: list[Message]) -> tuple[int, Any]:
        return next(self._turn) % len(self.engines), None


class LeastOutstanding(Router):
    def __init__(self, engines: Sequence[Engine], loop: VirtualLoop) -> None:
        super().__init__(engines, loop)
        self.outstanding = [0] * len(engines)
        self._turn = itertools.count()

    def pick(self, messages: list[Message]) -> tuple[int, Any]:
        n, offset = len(self.engines), next(self._turn)
        best = min(range(n), key=lambda i: self.outstanding[(i + offset) % n])
        return (best + offset) % n, None

    def started(self, index: int, context: Any) -> Any:
        self.outstanding[index] += 1

    def ended(self, index: int, context: Any, held: Any, prompt: int, cached: int) -> None:
        self.outstanding[index] -= 1


class Llmgw(Router):
    """The gateway's routing by the cache, as one web process runs it (``Placer``: its very
    choice, loads and learning)."""

    def __init__(self, engines: Sequence[Engine], loop: VirtualLoop) -> None:
        from gateway.routing.placing import Placer, routing_settings
        from gateway.routing.table import Route, Upstream

        super().__init__(engines, loop)
        upstreams = tuple(Upstream(f"static:sim{i}", "") for i in range(len(engines)))
        self.route = Route(sims.MODEL, None, upstreams)
        self.ids = [u.id for u in upstreams]
        self.placer = Placer()
        self.knobs = routing_settings()
        self.cache_tokens = (sims.KV_BLOCKS - 1) * sims.BLOCK_SIZE  # as the agents report it
        self.outcomes: dict[str, int] = {}
        self._turn = itertools.count()

    def pick(self, messages: list[Message]) -> tuple[int, Any]:
        from gateway.routing import prefix

        placer = self.placer
        # What a table load does: each mirror bounded by its engine's cache, in bytes.
        ceiling = placer.mirrors.token_bytes.bytes(self.cache_tokens)
        placer.mirrors.retain({uid: (1, ceiling) for uid in self.ids})
        knobs = self.knobs
        blocks = prefix.blocks_of(
            "chat", {"messages": messages}, knobs.block_bytes, knobs.max_blocks
        )
        choice = placer.choose(
            self.route,
            frozenset(),
            blocks=blocks,
            affinity=None,
            ejected_until={},
            now=self.loop.time(),
            offset=next(self._turn),
        )
        assert choice is not None
        self.outcomes[choice.outcome] = self.outcomes.get(choice.outcome, 0) + 1
        return self.ids.index(choice.upstream.id), (blocks, choice)

    def started(self, index: int, context: Any) -> Any:
        blocks, choice = context
        prefill = blocks.uncached(choice.predicted)
        return self.placer.loads.acquire(self.ids[index], prefill, self.loop.time(), blocks.lead)

    def first_token(self, index: int, context: Any, held: Any) -> None:
        self.placer.loads.answered(held, self.loop.time())

    def ended(self, index: int, context: Any, held: Any, prompt: int, cached: int) -> None:
        blocks, choice = context
        self.placer.loads.release(held)
        self.placer.measure(blocks, prompt)
        if blocks.keys:
            self.placer.learn(choice.upstream, blocks, choice.predicted, cached, prompt)


ROUTERS: dict[str, type[Router]] = {
    "llmgw": Llmgw,
    "least-outstanding": LeastOutstanding,
    "round-robin": RoundRobin,
}


@dataclass
class Cell:
    run: Run
    engines: list[Engine]
    router: Router


def run_cell(workload: str, router: type[Router], size: Size) -> Cell:
    loop = VirtualLoop()  # the workloads pace and time themselves by the loop's clock
    asyncio.set_event_loop(loop)
    try:
        config = engine_config()
        engines = [Engine(config, loop) for _ in range(sims.REPLICAS)]
        front = router(engines, loop)
        run = loop.run_until_complete((WORKLOADS | MORE_WORKLOADS)[workload](front.send, size))
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    return Cell(run, engines, front)


def row(workload: str, name: str, cell: Cell) -> str:
    outcomes = cell.run.outcomes
    ttfts = [o.ttft * 1000 for o in outcomes]
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    taken = [e.requests for e in cell.engines]
    tokens = sum(o.completion_tokens for o in outcomes)
    return (
        f"{workload:11} {name:18} {cached / max(1, prompt):7.4f} {percentile(ttfts, 0.5):9.1f} "
        f"{percentile(ttfts, 0.99):9.1f} {tokens / max(1e-9, cell.run.seconds):9.0f} "
        f"{max(taken) * len(taken) / max(1, sum(taken)):6.2f} "
        f"{max(e.peak_waiting for e in cell.engines):5d}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument(
        "--workload", action="append", choices=list(WORKLOADS | MORE_WORKLOADS), default=[]
    )
    parser.add_argument("--router", action="append", choices=list(ROUTERS), default=[])
    args = parser.parse_args()
    import django

    django.setup()  # the routing modules read their defaults from the settings module
    size = QUICK if args.quick else FULL
    print(
        f"{'workload':11} {'router':18} {'hit':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'out tok/s':>9} {'/mean':>6} {'wait':>5}"
    )
    started = time.process_time()
    for workload in args.workload or list(WORKLOADS | MORE_WORKLOADS):
        for name in args.router or list(ROUTERS):
            print(row(workload, name, run_cell(workload, ROUTERS[name], size)), flush=True)
    print(
        "(virtual time: TTFT in ms of the engines' own clock, no router or network time; hit: "
        "cached over prompt tokens; /mean: the busiest engine's requests over the mean; wait: "
        "the longest waiting queue an engine had)"
    )
    print(f"{time.process_time() - started:.1f} s of CPU", file=sys.stderr)


if __name__ == "__main__":
    main()
