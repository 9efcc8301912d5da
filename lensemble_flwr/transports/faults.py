"""A script of what goes wrong in an in-process federation (drops, delays, corruptions,
duplicates, rejoins). Tests and users import it from :mod:`lensemble_flwr.testing`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lensemble_flwr.protocol.messages import MessageKind
from lensemble_flwr.protocol.round import RoundState


@dataclasses.dataclass(frozen=True)
class _Drop:
    participant_id: str
    round: int
    at: RoundState


@dataclasses.dataclass(frozen=True)
class _Corrupt:
    participant_id: str
    round: int
    kind: MessageKind | str
    mutate: Callable[[dict[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class _Duplicate:
    participant_id: str
    round: int
    kind: MessageKind | str


def _round_number(round: int) -> int:
    if round < 1:  # a 0-based round index would never fire: say so instead
        raise ValueError(f"rounds are numbered from 1 (Flower's numbering), not {round}")
    return round


@dataclasses.dataclass
class FaultPlan:
    """A script of faults, keyed by participant and round number (Flower's: from 1).

    Each fault fires once, at the first attempt of its round that reaches it; a retried
    attempt of the same round runs without it unless it is scripted again.
    """

    drops: list[_Drop] = dataclasses.field(default_factory=list)
    rejoins: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    delays: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    corruptions: list[_Corrupt] = dataclasses.field(default_factory=list)
    duplicates: list[_Duplicate] = dataclasses.field(default_factory=list)

    def drop(self, participant_id: str, *, round: int, at: RoundState) -> FaultPlan:
        """Take the participant offline in ``round``: at OPEN it never sees RoundOpen; at
        COLLECTING it commits, then vanishes before its update leaves."""
        if at not in (RoundState.OPEN, RoundState.COLLECTING):
            raise ValueError("a participant can only drop while the round is OPEN or COLLECTING")
        self.drops.append(_Drop(participant_id, _round_number(round), at))
        return self

    def rejoin(self, participant_id: str, *, round: int) -> FaultPlan:
        """Bring the participant back (through ``Participant.join``) when ``round`` opens."""
        self.rejoins.setdefault(participant_id, []).append(_round_number(round))
        return self

    def delay(self, participant_id: str, *, round: int, seconds: float) -> FaultPlan:
        """Deliver the participant's update for ``round`` ``seconds`` later than usual."""
        self.delays[(participant_id, _round_number(round))] = seconds
        return self

    def corrupt(
        self,
        participant_id: str,
        *,
        round: int,
        kind: MessageKind | str,
        mutate: Callable[[dict[str, Any]], Any],
    ) -> FaultPlan:
        """Replace the participant's outgoing ``kind`` payload in ``round`` by
        ``mutate(payload_copy)``."""
        self.corruptions.append(_Corrupt(participant_id, _round_number(round), kind, mutate))
        return self

    def duplicate(
        self, participant_id: str, *, round: int, kind: MessageKind | str = MessageKind.UPDATE
    ) -> FaultPlan:
        """Send the participant's outgoing ``kind`` payload in ``round`` twice: the copy
        leaves right behind the original (the same delay, so it arrives right after it).
        The copy is the payload as the participant sent it: a corruption scripted for the
        same payload alters the first copy only."""
        self.duplicates.append(_Duplicate(participant_id, _round_number(round), kind))
        return self
