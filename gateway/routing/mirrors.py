"""What this web process expects each upstream's prefix cache to hold, and how it learns.

A mirror is a bounded, least-recently-used set of block keys (``gateway.routing.prefix``) per
upstream: a request routed to an upstream adds its prompt's blocks there, as the engine will
once it has prefilled them. The engine's own answer is the truth: its usage reports how many of
the prompt's tokens it found cached (``prompt_tokens_details.cached_tokens``), and a prediction
it contradicts corrects the mirror. An engine evicts least recently used blocks it no longer
runs, so a mirror that predicted more than the engine had was holding blocks the engine had
already dropped: its capacity was too large (other processes fill the engine's cache too, so a
mirror's honest capacity is this process's share of it) and it shrinks, dropping its oldest
blocks. An engine that had more than the mirror predicted grows it again, never past the
upstream's cache size (``ceiling``), so what a process remembers per upstream is bounded by
what that upstream can hold. A mirror counts what it holds in bytes of written-out prompt (its
blocks' sizes: they grow along a prompt, ``gateway.routing.prefix``) and engines tell their
cache's size in tokens, so each process also learns how many bytes of written-out prompt a token
is (``TokenBytes``) from the prompt tokens engines count in their usage. A replica that restarted
(a new generation), drained or left is forgotten whole (``Mirrors.retain``).

Blocks are added tail first, so the head of a prompt is the most recently used and a prefix
loses its tail before its head, the order in which vLLM frees a finished request's blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from gateway.routing.prefix import block_ends

# A mirror never shrinks below this many bytes (or its upstream's whole cache, where that is
# smaller): one contradicted guess must not make a process forget everything it knew.
FLOOR_BYTES = 32 * 1024
# A contradicted prediction keeps this share of the capacity (multiplicative decrease)...
SHRINK = 0.75
# ...and a prediction off by this many blocks or fewer is rounding, not a contradiction (the
# engine's report is in tokens, the mirror's blocks are bytes).
TOLERANCE_BLOCKS = 1
# A token is this many bytes of written-out prompt until engines' counts say otherwise (English
# text in today's tokenizers: about four)...
TOKEN_BYTES = 4.0
# ...then a moving average of what each prompt's count says, each held to this range first
# (CJK text is about two bytes a token, token ids written as JSON about six; nothing real is
# outside it), so one odd count, or an engine that lies, moves the estimate little.
TOKEN_BYTES_RANGE = (1.0, 16.0)
TOKEN_BYTES_WEIGHT = 1 / 64


class Learned(NamedTuple):
    """What an engine's report taught: how many blocks it really had cached, against the
    prediction, and what the mirror did about it (a tuple: one is made for every answer)."""

    confirmed: int
    predicted: int
    outcome: str  # "agreed", "denied" (the mirror shrank) or "surprised" (it grew)


class Mirror:
    """One upstream's expected cache: block keys with their sizes, the least recently used
    first; its capacity and ceiling are bytes."""

    __slots__ = ("_keys", "capacity", "ceiling", "held")

    def __init__(self, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self.capacity = self.ceiling
        self.held = 0  # bytes
        self._keys: OrderedDict[int, int] = OrderedDict()  # key -> its block's bytes

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def depth(self, keys: Iterable[int]) -> int:
        """How many leading ``keys`` this mirror holds."""
        held = self._keys
        depth = 0
        for key in keys:
            if key not in held:
                break
            depth += 1
        return depth

    def hold(self, keys: Sequence[int], ends: Sequence[int], known: int = 0) -> None:
        """The upstream is about to hold these blocks (``ends``: where each ends in the
        prompt): add them, tail first. ``known``: how many of the leading ones this mirror
        holds already (a prompt that was cached: most of them), only made the most recent."""
        self._add(keys, ends, known, len(keys))
        if known:
            try:  # in one pass in C: a long prompt's head is most of its blocks
                deque(map(self._keys.move_to_end, reversed(keys[:known])), maxlen=0)
            except KeyError:  # not all held after all: one at a time
                self._add(keys, ends, 0, known)
        if self.held > self.capacity:
            self._trim()

    def _add(self, keys: Sequence[int], ends: Sequence[int], start: int, stop: int) -> None:
        """Blocks ``start`` to ``stop`` of a prompt, the last first."""
        held = self._keys
        added = 0
        for index in range(stop - 1, start - 1, -1):
            key = keys[index]
            if key in held:
                held.move_to_end(key)
            else:
                size = ends[index] - (ends[index - 1] if index else 0)
                held[key] = size
                added += size
        self.held += added

    def shrink(self) -> None:
        self.capacity = max(min(FLOOR_BYTES, self.ceiling), int(self.capacity * SHRINK))
        self._trim()

    def grow(self, size: int) -> None:
        self.capacity = min(self.ceiling, self.capacity + size)

    def resize(self, ceiling: int) -> None:
        """The upstream's cache size changed (or became known), in bytes."""
        self.ceiling = max(1, ceiling)
        self.capacity = min(self.capacity, self.ceiling)
        self._trim()

    def _trim(self) -> None:
        held = self._keys
        while self.held > self.capacity and held:
            _, size = held.popitem(last=False)
            self.held -= size


class TokenBytes:
    """How many bytes of written-out prompt (``gateway.routing.prefix``) an engine's token is,
    as this process has seen engines count them: what turns a cache size reported in tokens
    into a mirror's ceiling in blocks. The prompt tokens an engine counts include its chat
    template's own, which its cache holds too, so this is the ratio its cache fills at."""

    __slots__ = ("value",)

    def __init__(self, start: float = TOKEN_BYTES) -> None:
        self.value = start

    def learn(self, size: int, tokens: int) -> None:
        """An engine counted ``tokens`` prompt tokens in a prompt written out as ``size`` bytes."""
        if size <= 0 or tokens <= 0:
            return
        low, high = TOKEN_BYTES_RANGE
        ratio = min(high, max(low, size / tokens))
        self.value += (ratio - self.value) * TOKEN_BYTES_WEIGHT

    def bytes(self, tokens: int) -> int:
        """How many bytes of written-out prompt a cache of ``tokens`` tokens holds."""
        return max(1, int(tokens * self.value))


def matches(
    mirrors: Mapping[str, Mirror], ids: Iterable[str], keys: tuple[int, ...]
) -> dict[str, int]:
    """For each upstream id with a mirror, how many leading blocks of ``keys`` it holds: each
    walks the keys to its first missing one, so a prompt nobody holds costs one lookup each."""
    found: dict[str, int] = {}
    for uid in ids:
        mirror = mirrors.get(uid)
        if mirror is not None:
            found[uid] = mirror.depth(keys)
    return found


class Mirrors:
    """Every upstream's mirror in this process, kept to the upstreams that serve now."""

    def __init__(self, default_ceiling: int, block_bytes: int, max_blocks: int) -> None:
        self.default_ceiling = default_ceiling  # bytes, where an upstream's cache is not known
        self.ends = block_ends(block_bytes, max_blocks)  # where each block ends in a prompt
        self.by_upstream: dict[str, Mirror] = {}
        self._generations: dict[str, int] = {}
        self._ceilings: dict[str, int] = {}  # the cache sizes upstreams reported, in bytes
        self.token_bytes = TokenBytes()

    def matches(self, ids: Iterable[str], keys: tuple[int, ...]) -> dict[str, int]:
        if not keys or not self.by_upstream:
            return {}
        return matches(self.by_upstream, ids, keys)

    def hold(self, upstream_id: str, keys: tuple[int, ...], known: int = 0) -> None:
        """``upstream_id`` is about to hold these blocks (no more than a prompt is cut into:
        a peer's placement may say more), ``known`` of the leading ones held already."""
        if not keys:
            return
        if len(keys) > len(self.ends):
            keys = keys[: len(self.ends)]
        mirror = self.by_upstream.get(upstream_id)
        if mirror is None:
            ceiling = self._ceilings.get(upstream_id, self.default_ceiling)
            mirror = self.by_upstream[upstream_id] = Mirror(ceiling)
        mirror.hold(keys, self.ends, min(known, len(keys)))

    def learn(self, upstream_id: str, predicted: int, confirmed: int) -> Learned:
        """Correct ``upstream_id``'s mirror by what its engine reported it had cached (in
        blocks of the prompt)."""
        mirror = self.by_upstream.get(upstream_id)
        if mirror is None:
            return Learned(confirmed, predicted, "agreed")
        if confirmed < predicted - TOLERANCE_BLOCKS:
            mirror.shrink()
            return Learned(confirmed, predicted, "denied")
        if confirmed > predicted + TOLERANCE_BLOCKS:
            mirror.grow(self._through(confirmed) - self._through(predicted))
            return Learned(confirmed, predicted, "surprised")
        return Learned(confirmed, predicted, "agreed")

    def _through(self, blocks: int) -> int:
        blocks = min(blocks, len(self.ends))
        return self.ends[blocks - 1] if blocks > 0 else 0

    def retain(self, live: Mapping[str, tuple[int, int | None]]) -> None:
        """Keep the mirrors of the upstreams in ``live`` (id → (generation, cache size in
        bytes or None)); forget the others, and any whose upstream restarted since."""
        for uid in [u for u in self.by_upstream if u not in live]:
            del self.by_upstream[uid]
        self._generations = {u: g for u, g in self._generations.items() if u in live}
        self._ceilings = {}
        for uid, (generation, ceiling) in live.items():
            if self._generations.get(uid, generation) != generation:
                self.by_upstream.pop(uid, None)
            self._generations[uid] = generation
            if ceiling:
                self._ceilings[uid] = ceiling
            mirror = self.by_upstream.get(uid)
            if mirror is not None:
                mirror.resize(ceiling or self.default_ceiling)
