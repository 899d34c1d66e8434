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

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

NONE_HASH: Final = 0  # the parent of a sequence's first block


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

    def __init__(self) -> None:
        self.hash: int | None = None
        self.ref = 0


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
        found: list[Block] = []
        if not self.caching:
            return found
        cached = self._cached
        for block_hash in hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def can_take(self, new: int, hits: Iterable[Block]) -> bool:
        """Whether ``new`` blocks can be allocated after ``hits`` are taken: a hit on a free
        block takes that block out of the free queue (vLLM counts it the same way)."""
        return new + sum(1 for block in hits if block.ref == 0) <= self.free

    def touch(self, blocks: Iterable[Block]) -> None:
        """Hold cached blocks that a sequence hit."""
        free = self._free
        for block in blocks:
            if block.ref == 0:
                del free[block]
            block.ref += 1

    def allocate(self, count: int) -> list[Block]:
        """``count`` blocks from the head of the free queue, evicting what they cached; the
        caller has checked there are enough (``can_take``)."""
        if count > self.free:
            raise ValueError(f"{count} blocks asked, {self.free} free")
        blocks: list[Block] = []
        for _ in range(count):
            if self._blank:
                self._blank -= 1
                block = Block()
            else:
                block, _ = self._free.popitem(last=False)
                if block.hash is not None:
                    if self._cached.get(block.hash) is block:
                        del self._cached[block.hash]
                    block.hash = None
            block.ref = 1
            blocks.append(block)
        return blocks

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
