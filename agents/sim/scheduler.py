"""Which requests of one simulated engine run, which wait, and what each finds in the KV cache:
vLLM's v1 scheduler with its default first-come-first-served policy
(``vllm/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``), reduced to what decides a
request's wait, its time to first token and its ``cached_tokens``.

- A request is scheduled when fewer than ``max_num_seqs`` run and the pool can give it the blocks
  of its prompt; otherwise it waits, and everything behind it waits too (vLLM stops scheduling
  at the first waiting request that does not fit).
- Scheduling looks up the prompt's block hashes: the longest cached run is a hit, but never the
  prompt's last token, which must be computed to sample from (vLLM's ``num_tokens - 1``), so a
  prompt that is all cached still computes its last block. The hits are ``cached_tokens``; the
  prompt's tokens and the hits add to ``vllm:prefix_cache_queries`` and ``..._hits``.
- Prefill is compute-bound, so one runs at a time: the uncached tokens of each scheduled request
  take ``uncached / prefill_tokens_per_s`` seconds in one lane, in order, and a long miss
  delays every request scheduled after it.
- While decoding, a request holds the blocks of its prompt and of what it generated; full ones
  are cached as they fill (the answer's blocks too, so the next turn of a chat hits them). When
  a token needs a block and none is free, the most recently scheduled request is preempted
  (possibly the one asking): its blocks are freed, it goes back to the head of the queue and,
  scheduled again, recomputes what is no longer cached (vLLM's recompute preemption).
- A finished request gives its blocks back tail first; they stay cached until evicted.

Time is the caller's: the scheduler is handed a clock and answers when a prefill ends; the
server sleeps. Waiting is an asyncio future per request, resolved in queue order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agents.sim.kvcache import NONE_HASH, Block, BlockPool, chain_hashes
from agents.sim.prompts import output_tokens


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(eq=False, slots=True)
class TokenSequence:
    """One prompt and what is generated after it: its block hashes so far and its blocks."""

    prompt: list[str] = field(repr=False)
    root: int = NONE_HASH  # the parent of its first block
    hashes: list[int] = field(default_factory=list, repr=False)
    blocks: list[Block] = field(default_factory=list, repr=False)
    registered: int = 0  # blocks of ``blocks`` registered in the cache under their hash

    def hash_blocks(self, count: int, block_size: int) -> None:
        """Extend ``hashes`` to the first ``count`` full blocks of prompt plus output."""
        have = len(self.hashes)
        if count <= have:
            return
        prompt = self.prompt
        start, end = have * block_size, count * block_size
        tokens = prompt[start:end]
        if end > len(prompt):
            tokens += output_tokens(max(0, start - len(prompt)), end - len(prompt))
        parent = self.hashes[-1] if have else self.root
        self.hashes += chain_hashes(tokens, block_size, parent)


@dataclass(eq=False, slots=True)
class Work:
    """A request as the scheduler sees it."""

    seqs: list[TokenSequence]
    prompt_tokens: int  # of all its sequences
    cached_override: int | None = None  # a fault or flag: report this many cached tokens
    emitted: int = 0  # tokens generated so far (per sequence)
    scheduled: bool = False  # scheduled at least once: its cache lookup is counted
    preempted: bool = False
    cached: int = 0  # cached_tokens, as reported
    ready_at: float = 0.0  # when its latest prefill is done
    due: float = 0.0  # when its latest token was due
    admitted: asyncio.Future[None] | None = None


class Scheduler:
    """Admission, the prefill lane and preemption over one :class:`BlockPool`."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        prefill_tokens_per_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs  # 0: no limit
        self.prefill_tokens_per_s = prefill_tokens_per_s  # 0: prefill takes no time
        self.clock = clock
        self.running: dict[Work, None] = {}  # in scheduling order, the last preempted first
        self.waiting: deque[Work] = deque()
        self.lane_free_at = 0.0
        self.queries = 0  # vllm:prefix_cache_queries: prompt tokens looked up
        self.hits = 0  # vllm:prefix_cache_hits: of them, the cached ones (as reported)
        self.preemptions = 0
        self._freed = False  # a preemption freed blocks that waiting requests may now use

    # ---- scheduling

    def run_now(
        self, prompts: Sequence[list[str]], root: int, tokens: int, override: int | None
    ) -> int | None:
        """Run a request that generates all ``tokens`` at once (the instant mode) if nothing
        waits and the blocks of its whole answer are free now: looked up, cached and given
        back in one go. Its ``cached_tokens``, or None if it must wait like any other."""
        if self.waiting or (self.max_num_seqs and len(self.running) >= self.max_num_seqs):
            return None
        if len(prompts) != 1:  # a batch, or a pooled request with no prompt to cache
            work = work_for(prompts, override, root)
            if not self._schedule(work, tokens):
                return None
            self.release(work)
            return work.cached
        # The hot path of every benchmark: one sequence, no objects but the blocks.
        pool = self.pool
        size = pool.block_size
        prompt = prompts[0]
        length = len(prompt)
        known = length + tokens - 1  # the KV of all but the last generated token
        if known > length:
            hashes = chain_hashes(prompt + output_tokens(0, known - length), size, root)
        else:
            hashes = chain_hashes(prompt, size, root)
        lookup = (length - 1) // size  # never the prompt's last token
        hits = pool.hits(hashes[:lookup]) if lookup else []
        if not pool.cycle(hits, _blocks_for(known, size) - len(hits), hashes[len(hits) :]):
            return None
        return self._count_lookup(length, len(hits) * size, override)

    async def admit(self, work: Work) -> None:
        """Schedule ``work`` now, or wait in line until it is."""
        if not self.waiting and self._schedule(work, 1):
            return
        self.waiting.append(work)
        await self._wait(work)

    async def resume(self, work: Work) -> None:
        """After a preemption: wait at the head of the line until scheduled again."""
        if work.preempted:
            await self._wait(work)

    async def _wait(self, work: Work) -> None:
        future = work.admitted = asyncio.get_running_loop().create_future()
        try:
            await future
        finally:
            work.admitted = None

    def _schedule(self, work: Work, upto: int) -> bool:
        """Take the blocks for ``work``'s sequences up to output token ``upto`` if they fit,
        hitting the cache for everything known so far; False if they do not fit."""
        if self.max_num_seqs and len(self.running) >= self.max_num_seqs:
            return False
        pool = self.pool
        size = pool.block_size
        looked: list[list[Block]] = []
        every_hit: list[Block] = []
        new = 0
        for seq in work.seqs:
            lookup = (len(seq.prompt) + work.emitted - 1) // size  # never the last known token
            seq.hash_blocks(lookup, size)
            hits = pool.hits(seq.hashes[:lookup])
            looked.append(hits)
            every_hit += hits
            new += _blocks_for(len(seq.prompt) + upto - 1, size) - len(hits)
        if not pool.can_take(new, every_hit):
            return False
        pool.touch(every_hit)
        for seq, hits in zip(work.seqs, looked, strict=True):
            fresh = _blocks_for(len(seq.prompt) + upto - 1, size) - len(hits)
            seq.blocks = hits + pool.allocate(fresh)
            seq.registered = len(hits)
        self._register(work, upto)
        self.running[work] = None
        work.preempted = False
        hit_tokens = len(every_hit) * size
        computed = work.prompt_tokens + work.emitted * len(work.seqs)
        rate = self.prefill_tokens_per_s
        now = self.clock()
        if rate:
            start = max(now, self.lane_free_at)
            work.ready_at = self.lane_free_at = start + (computed - hit_tokens) / rate
        else:
            work.ready_at = now
        if not work.scheduled:
            self._looked_up(work, hit_tokens)
        return True

    def _looked_up(self, work: Work, hit_tokens: int) -> None:
        """A request's first cache lookup: what it reports, and the prefix cache counters."""
        work.scheduled = True
        if work.seqs:  # a pooled request (embeddings, rerank) has nothing to look up
            work.cached = self._count_lookup(work.prompt_tokens, hit_tokens, work.cached_override)

    def _count_lookup(self, prompt: int, hit_tokens: int, override: int | None) -> int:
        """What a first lookup reports (the flag or fault over what hit), counted."""
        cached = hit_tokens if override is None else min(override, prompt)
        if self.pool.caching:
            self.queries += prompt
            self.hits += cached
        return cached

    def _register(self, work: Work, upto: int) -> None:
        """Cache each sequence's blocks that are full once output token ``upto`` is sampled
        (its KV then covers the prompt and the ``upto - 1`` tokens before it)."""
        size = self.pool.block_size
        for seq in work.seqs:
            full = (len(seq.prompt) + upto - 1) // size
            if full > seq.registered:
                seq.hash_blocks(full, size)
                for index in range(seq.registered, full):
                    self.pool.cache(seq.blocks[index], seq.hashes[index])
                seq.registered = full

    def grow(self, work: Work, upto: int) -> bool:
        """Give ``work`` the blocks output token ``upto`` needs, preempting the most recently
        scheduled requests while none are free; False if ``work`` itself is preempted."""
        if work.preempted:
            return False
        size = self.pool.block_size
        if len(work.seqs) == 1 and not self._freed:  # most tokens: nothing to do
            seq = work.seqs[0]
            known = len(seq.prompt) + upto - 1
            if known <= len(seq.blocks) * size and known // size <= seq.registered:
                return True
        # Blocks an earlier step's preemption left free go to waiting requests now, a step
        # later, as vLLM schedules none in the step that preempts.
        after_preemption, self._freed = self._freed, False
        pool = self.pool
        short = [
            _blocks_for(len(seq.prompt) + upto - 1, size) - len(seq.blocks) for seq in work.seqs
        ]
        while sum(short) > pool.free:
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim is work:
                return False
        for seq, count in zip(work.seqs, short, strict=True):
            if count > 0:
                seq.blocks += pool.allocate(count)
        self._register(work, upto)
        if after_preemption:
            self._pump()
        return True

    def _preempt(self, work: Work) -> None:
        """Free a running request's blocks and put it first in line, to be recomputed."""
        del self.running[work]
        self._free(work)
        work.preempted = True
        self.waiting.appendleft(work)
        self.preemptions += 1
        self._freed = True

    def _free(self, work: Work) -> None:
        blocks: list[Block] = []
        for seq in work.seqs:
            blocks += seq.blocks
            seq.blocks, seq.registered = [], 0
        self.pool.release(reversed(blocks))  # tail first, as vLLM frees them

    def release(self, work: Work) -> None:
        """A request is done (finished, failed or gone): give back what it holds, schedule
        whoever can run now."""
        if work in self.running:
            del self.running[work]
            self._free(work)
        elif self.waiting and work in self.waiting:
            self.waiting.remove(work)
        self._pump()

    def _pump(self) -> None:
        """Schedule waiting requests in order, up to the first that does not fit."""
        waiting = self.waiting
        while waiting:
            head = waiting[0]
            if not self._schedule(head, head.emitted + 1):
                return
            waiting.popleft()
            if head.admitted is not None and not head.admitted.done():
                head.admitted.set_result(None)

    # ---- what the metrics read

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def work_for(
    prompts: Sequence[list[str]], cached_override: int | None, root: int = NONE_HASH
) -> Work:
    """The scheduler's view of a request with these prompts (one sequence each, its first
    block hanging from ``root``)."""
    seqs = [TokenSequence(p, root) for p in prompts]
    return Work(seqs, sum(map(len, prompts)), cached_override)
