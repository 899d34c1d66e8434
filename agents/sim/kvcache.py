"""An engine's KV cache as vLLM's v1 block pool keeps it (``vllm/v1/core/block_pool.py``,
``kv_cache_utils.py``): fixed-size blocks of tokens, a hash per full block chained over every
block before it, and one queue of free blocks that is also the eviction order.

- Only full blocks are hashed and cached; a block's hash is ``hash((parent, *its tokens))``, so
  two sequences share a block only when they share everything before it too.
- A block is held (``ref`` > 0) by each running sequence that uses it. A held block is never
  evicted. A block no one holds stays cached and goes to the tail of the free queue; the queue
  is least recently used first, so allocation takes (and evicts) from its head. A finished
  sequence gives its blocks back tail first (vLLM frees them in reverse), so of a cached prefix
  its tail is evicted before its head, and a later request still finds the head.
- A hit takes a cached block back out of the free queue (vLLM's ``touch``).
- Block 0 is vLLM's null block: ``num_blocks`` blocks configured, ``num_blocks - 1`` usable,
  and the usage (``vllm:kv_cache_usage_perc``) is the share of usable blocks held.

Blocks never used yet are only a count (they sit at the head of vLLM's queue, in id order, and
leave it before any freed block), so an idle pool of any size costs nothing: a fleet runs a
thousand simulators in one process.

Pure: no clock, no I/O, no asyncio. The Python hash is per process (as vLLM's NONE_HASH is
random per process unless PYTHONHASHSEED is set) and hashes a block's tokens in C.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import attrgetter, not_
from typing import Final, cast

NONE_HASH: Final = 0  # the parent of a sequence's first block
_REF: Final = attrgetter("ref")


def chain_hashes(
    tokens: Sequence[str], block_size: int, parent: int = NONE_HASH, *, start: int = 0
) -> list[int]:
    """The hashes of the full blocks of ``tokens`` from block ``start`` on, each chained on
    ``parent``, the hash of the block before (``NONE_HASH`` for the first)."""
    hashes: list[int] = []
    end = len(tokens) - block_size
    for at in range(start * block_size, end + 1, block_size):
        parent = hash((parent, *tokens[at : at + block_size]))
        hashes.append(parent)
    return hashes


class Block:
    """One block of KV cache: its hash while it is cached, and how many sequences hold it."""

    __slots__ = ("hash", "ref")

    def __init__(self, ref: int = 0) -> None:
        self.hash: int | None = None
        self.ref = ref


class BlockPool:
    """The blocks of one engine and the map from block hash to the cached block."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("a block pool needs at least two blocks of at least one token")
        self.block_size = block_size
        self.usable = num_blocks - 1
        self.caching = caching
        self._blank = self.usable  # never used: the head of the free queue
        self._free: OrderedDict[Block, None] = OrderedDict()  # freed, least recent first
        self._cached: dict[int, Block] = {}

    @property
    def free(self) -> int:
        """Blocks that can be allocated (cached ones among them are evicted when they are)."""
        return self._blank + len(self._free)

    @property
    def held(self) -> int:
        return self.usable - self.free

    @property
    def usage(self) -> float:
        return self.held / self.usable

    @property
    def cached(self) -> int:
        """Blocks whose contents a request could still hit."""
        return len(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def hits(self, hashes: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest run of ``hashes`` from the start."""
        if not self.caching or not hashes:
            return []
        found = list(map(self._cached.get, hashes))  # in C: a prompt has hundreds of blocks
        with contextlib.suppress(ValueError):  # no miss: all of them hit
            del found[found.index(None) :]
        return cast(list[Block], found)

    def can_take(self, new: int, hits: Sequence[Block]) -> bool:
        """Whether ``new`` blocks can be allocated after ``hits`` are taken: a hit on a free
        block takes that block out of the free queue (vLLM counts it the same way)."""
        return new + list(map(_REF, hits)).count(0) <= self.free

    def touch(self, blocks: Iterable[Block]) -> None:
        """Hold cached blocks that a sequence hit."""
        free = self._free
        for block in blocks:
            if block.ref == 0:
                del free[block]
            block.ref += 1

    def allocate(self, count: int, *, ref: int = 1) -> list[Block]:
        """``count`` blocks from the head of the free queue, evicting what they cached; the
        caller has checked there are enough (``can_take``)."""
        if count > self.free:
            raise ValueError(f"{count} blocks asked, {self.free} free")
        blank = min(count, self._blank)
        self._blank -= blank
        blocks = [Block(ref) for _ in range(blank)]
        if blank < count:
            pop, cached = self._free.popitem, self._cached
            for _ in range(count - blank):
                block, _ = pop(last=False)
                if block.hash is not None:
                    if cached.get(block.hash) is block:
                        del cached[block.hash]
                    block.hash = None
                block.ref = ref
                blocks.append(block)
        return blocks

    def cycle(self, hits: Sequence[Block], new: int, hashes: Sequence[int]) -> bool:
        """A sequence that runs to its end at once (the instant mode), in one go: as if it
        took ``hits`` and ``new`` blocks, cached the new ones that ``hashes`` name (in order),
        and gave them all back tail first; False, and nothing changed, if they do not fit.

        Taking a free hit and giving it back moves it to the tail of the free queue, after the
        new blocks. Where the allocation takes freed blocks (not only never used ones), the
        free hits first move to the tail out of its way: it takes no more than the others."""
        free_hits = list(compress(hits, map(not_, map(_REF, hits)))) if hits else []
        if new + len(free_hits) > self.free:
            return False
        move = self._free.move_to_end
        if free_hits and new > self._blank:
            deque(map(move, free_hits), maxlen=0)
        blocks = self.allocate(new, ref=0)
        if self.caching:
            cached = self._cached
            for block, block_hash in zip(blocks, hashes, strict=False):  # not the partial one
                if block_hash not in cached:
                    block.hash = block_hash
                    cached[block_hash] = block
        self._free.update(zip(reversed(blocks), repeat(None)))
        if free_hits:
            deque(map(move, reversed(free_hits)), maxlen=0)
        return True

    def cache(self, block: Block, block_hash: int) -> None:
        """Register a full block under its hash. A hash already cached keeps its block (this
        one stays uncached: a lookup finds the first, as vLLM's does)."""
        if self.caching and block.hash is None and block_hash not in self._cached:
            block.hash = block_hash
            self._cached[block_hash] = block

    def release(self, blocks: Iterable[Block]) -> None:
        """Give blocks back in the order given; those no one holds any more join the tail of
        the free queue, still cached."""
        free = self._free
        for block in blocks:
            block.ref -= 1
            if block.ref == 0:
                free[block] = None
