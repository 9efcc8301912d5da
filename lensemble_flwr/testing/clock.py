"""A clock that only moves when told: for the parts that take an injected clock and
sleep (the shared-folder barrier's ``clock=`` and ``sleep=``)."""

from __future__ import annotations


class ManualClock:
    """Monotonic seconds that only a ``sleep`` (or :meth:`advance`) moves.

    Call it for the time; pass ``clock=c, sleep=c.sleep`` to what takes both, so waiting
    costs no wall time and every run is the same.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        """The current time, in seconds."""
        self.sleeps: list[float] = []
        """Every ``sleep`` asked for, in order."""

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        """Move the clock ``seconds`` on at once (negative: refused)."""
        if seconds < 0:
            raise ValueError(f"cannot sleep {seconds!r} seconds")
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on without counting a sleep (time passing elsewhere)."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back {-seconds!r} seconds")
        self.now += seconds
