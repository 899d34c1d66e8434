"""How much of this process's recent traffic each prefix (or session) is.

A prefix hotter than one upstream's fair share of the traffic cannot be served by one
upstream however the rest is placed, so routing spreads it at the mean load; a cooler one is
kept where its cache is until its upstream is loaded well past the mean, since moving it costs
a prefill elsewhere and cache the others need (``gateway.routing.choice``). The share is a
count of requests that decays with every request routed (a window of about ``window``
requests), kept for a bounded number of keys: the coolest are dropped first.
"""

from __future__ import annotations

# Keys remembered at most this many times the window: the coolest half goes past it.
_KEYS_PER_WINDOW = 4


class Shares:
    """Decayed request counts per key; ``share(key)`` is the key's part of the recent total."""

    __slots__ = ("_counts", "_decay", "_tick", "window")

    def __init__(self, window: int = 1000) -> None:
        self.window = window
        self._decay = 1.0 - 1.0 / window
        self._tick = 0
        self._counts: dict[int, tuple[float, int]] = {}  # key -> (count, tick it was counted at)

    def count(self, key: int) -> float:
        """Count one request of ``key``; its share of the recent requests, counted one."""
        self._tick += 1
        tick = self._tick
        count, at = self._counts.get(key, (0.0, tick))
        count = count * self._decay ** (tick - at) + 1.0
        self._counts[key] = (count, tick)
        if len(self._counts) > _KEYS_PER_WINDOW * self.window:
            self._forget_coolest()
        # The decayed total of every request so far: a geometric sum, at most the window.
        total = (1.0 - self._decay**tick) / (1.0 - self._decay)
        return count / total

    def _forget_coolest(self) -> None:
        tick = self._tick
        decayed = sorted(
            (count * self._decay ** (tick - at), key) for key, (count, at) in self._counts.items()
        )
        for _, key in decayed[: len(decayed) // 2]:
            del self._counts[key]
