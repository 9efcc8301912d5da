"""The outcomes a coordinator reports, the latest few kept in memory.

Every attempt's :class:`~lensemble_flwr.coordinator.attempt.RoundOutcome` lists its
contributors, so a list of all of them grows by O(C) per round without end. A
:class:`RecentOutcomes` numbers the outcomes from the first the coordinator reported (its
positions are those a list of all of them would have: ``len`` counts every one, ``[-1]``
is the latest, ``[n:]`` those since ``n``) but keeps only the latest ``keep``. Reading an
older position raises :class:`~lensemble_flwr.errors.OutcomeForgotten`: the run manifest
in the store (``Coordinator.manifest``, ``RunManifest.entry``) records every attempt, and
recovery, ``lensemble-flwr show`` and the ledger read it from there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import overload

from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.errors import OutcomeForgotten

KEEP_OUTCOMES = 16
"""How many of the latest outcomes a coordinator keeps by default (at least as many as a
round may have attempts: a caller reads one round's attempts after it ends)."""


class RecentOutcomes(Sequence[RoundOutcome]):
    """Every reported outcome by position, the latest ``keep`` of them held (see module).

    Raises:
        ValueError: ``keep`` is below 1.
    """

    def __init__(self, keep: int = KEEP_OUTCOMES) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        self._kept: deque[RoundOutcome] = deque(maxlen=keep)
        self._reported = 0

    @property
    def first(self) -> int:
        """The position of the oldest outcome still kept (0 until one is forgotten)."""
        return self._reported - len(self._kept)

    def append(self, outcome: RoundOutcome) -> None:
        """Report one more outcome (the oldest kept one is forgotten when full)."""
        self._kept.append(outcome)
        self._reported += 1

    def __len__(self) -> int:
        return self._reported

    def _at(self, position: int) -> RoundOutcome:
        if position < self.first:
            raise OutcomeForgotten(
                f"outcome {position} is no longer kept (the coordinator keeps outcomes "
                f"{self.first} to {self._reported - 1}); the run manifest records every attempt"
            )
        return self._kept[position - self.first]

    @overload
    def __getitem__(self, index: int) -> RoundOutcome: ...

    @overload
    def __getitem__(self, index: slice) -> list[RoundOutcome]: ...

    def __getitem__(self, index: int | slice) -> RoundOutcome | list[RoundOutcome]:
        if isinstance(index, slice):
            return [self._at(i) for i in range(*index.indices(self._reported))]
        position = index + self._reported if index < 0 else index
        if not 0 <= position < self._reported:
            raise IndexError(f"outcome {index} out of range ({self._reported} reported)")
        return self._at(position)

    def __iter__(self) -> Iterator[RoundOutcome]:
        """Every outcome in order; raises OutcomeForgotten if the first ones are gone."""
        if self.first:
            self._at(0)
        return iter(list(self._kept))

    def __eq__(self, other: object) -> bool:
        """Equal to a list or tuple of the same outcomes when nothing is forgotten, and
        to another RecentOutcomes holding the same ones at the same positions."""
        if isinstance(other, RecentOutcomes):
            return (self.first, list(self._kept)) == (other.first, list(other._kept))
        if isinstance(other, (list, tuple)):
            return not self.first and list(self._kept) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RecentOutcomes(first={self.first}, kept={list(self._kept)!r})"
