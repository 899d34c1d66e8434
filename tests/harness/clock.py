"""A clock the test moves by hand, for code that takes its clock as an argument."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SteppingClock(FakeClock):
    """A clock that moves ``step`` seconds each time it is read: to code that reads it before
    and after a call, every call seems to take that long (a slow store)."""

    def __init__(self, step: float, start: float = 1000.0) -> None:
        super().__init__(start)
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now
