"""How long an attempt waits in OPEN and in COLLECTING: fixed, or following the federation.

``deadline-mode = "fixed"`` (the library's default): every attempt waits ``open-timeout``
seconds in OPEN and ``collect-timeout`` seconds in COLLECTING, as before.

``deadline-mode = "adaptive"``: each phase of an attempt waits

    clamp(deadline-margin × the longest of the last ADAPTIVE_WINDOW round times,
          deadline-floor, deadline-cap)

seconds, where a round's time is what its closing attempt took from the start of its
wait to its last admitted update (the time its contributors needed, however long the
attempt went on waiting for a silent one afterwards). Until a round has closed in this
coordinator (round 1, or the first round after a resume), and in the attempt after an
aborted one (a retry: the federation may have slowed down past the margin), both phases
wait ``deadline-cap``. The value depends only on the observed times, so on a simulated clock
a run is the same every time.

Every attempt carries the :class:`PhaseDeadlines` it used (its outcome too), and an
attempt that aborts at a deadline names it, in seconds, with the key that set it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from typing import Literal

from lensemble_flwr.config import NAMESPACE, FederationConfig

ADAPTIVE_WINDOW = 5
"""Closed rounds whose times the adaptive deadline looks at (the most recent ones)."""

Phase = Literal["open", "collect"]


def adaptive_deadline(
    observed: Iterable[float], *, floor: float, cap: float, margin: float
) -> float:
    """``margin`` × the longest of ``observed`` round times, within [``floor``, ``cap``];
    ``cap`` when nothing was observed.

    Raises:
        ValueError: ``floor`` above ``cap``, a margin below 1, or a negative time.
    """
    if floor > cap or margin < 1:
        raise ValueError(f"need floor <= cap and margin >= 1 (got {floor}, {cap}, {margin})")
    times = list(observed)
    if any(t < 0 for t in times):
        raise ValueError(f"round times cannot be negative: {times}")
    if not times:
        return cap
    return min(cap, max(floor, margin * max(times)))


@dataclasses.dataclass(frozen=True)
class PhaseDeadlines:
    """The deadlines one attempt waits for, and where they come from.

    ``open`` and ``collect`` are seconds (without a first attempt's warm-up grace);
    ``basis`` says, in adaptive mode, what they were computed from.
    """

    open: float
    collect: float
    mode: Literal["fixed", "adaptive"]
    basis: str = ""

    def seconds(self, phase: Phase) -> float:
        """``phase``'s deadline in seconds."""
        return self.open if phase == "open" else self.collect

    def key(self, phase: Phase) -> str:
        """The run_config key that set ``phase``'s deadline."""
        if self.mode == "fixed":
            return f"{NAMESPACE}{phase}-timeout"
        return f"{NAMESPACE}deadline-mode"

    def describe(self, phase: Phase, grace: float = 0.0) -> str:
        """``phase``'s deadline for an abort reason, e.g. ``60 s, lensemble.collect-timeout``."""
        text = f"{_seconds(self.seconds(phase))} s, {self.key(phase)}"
        if self.mode == "adaptive":
            text += f" = adaptive: {self.basis}"
        if grace > 0:
            text += f"; + {_seconds(grace)} s warm-up grace"
        return text


class DeadlineTracker:
    """The deadlines of a coordinator's next attempt, from the round times it observed."""

    def __init__(self, federation: FederationConfig) -> None:
        self._fed = federation
        self._times: deque[float] = deque(maxlen=ADAPTIVE_WINDOW)
        self._retrying = False  # the last attempt aborted: the next one waits the cap

    @property
    def observed(self) -> tuple[float, ...]:
        """The round times the next adaptive deadline is computed from (oldest first)."""
        return tuple(self._times)

    def observe(self, seconds: float) -> None:
        """A round closed; its contributors took ``seconds`` (see the module).

        Raises:
            ValueError: a negative time.
        """
        if seconds < 0:
            raise ValueError(f"a round time cannot be negative: {seconds}")
        self._times.append(float(seconds))
        self._retrying = False

    def aborted(self) -> None:
        """An attempt aborted: the next one (its retry) waits ``deadline-cap``."""
        self._retrying = True

    def next(self) -> PhaseDeadlines:
        """The deadlines the next attempt waits for."""
        fed = self._fed
        if fed.deadline_mode == "fixed":
            return PhaseDeadlines(fed.open_timeout, fed.collect_timeout, "fixed")
        times = () if self._retrying else tuple(self._times)
        value = adaptive_deadline(
            times, floor=fed.deadline_floor, cap=fed.deadline_cap, margin=fed.deadline_margin
        )
        bounds = f"within [{_seconds(fed.deadline_floor)}, {_seconds(fed.deadline_cap)}] s"
        if self._retrying:
            basis = f"a retry after an aborted attempt: deadline-cap ({bounds})"
        elif not self._times:
            basis = f"no round observed yet: deadline-cap ({bounds})"
        else:
            basis = (
                f"{fed.deadline_margin:g} x {_seconds(max(self._times))} s, the longest of the "
                f"last {len(self._times)} round times, {bounds}"
            )
        return PhaseDeadlines(value, value, "adaptive", basis)


def _seconds(value: float) -> str:
    """Seconds as a short number: ``60``, ``12.5``."""
    return f"{value:.1f}".removesuffix(".0")
