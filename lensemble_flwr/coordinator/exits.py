"""How a round leaves OPEN and COLLECTING: the exit rules its round table names.

:meth:`~.core.RoundCore.advance` looks the attempt's phase up in the mode's round table
(:mod:`.admission`) and asks that row's :class:`ExitRule` whether the phase is over; if
so, it fires the rule's event. A rule that can tell the quorum will not be met raises
:class:`~lensemble_flwr.errors.FaultToleranceExceeded` (the attempt aborts):

* OPEN is left once K = max(min-participants, secagg-threshold) participants are ready
  (what "ready" means is the mode's: invited, bound, or members of a masked round);
* COLLECTING is left once no eligible, reachable participant is still to deliver, or at
  the deadline with K updates; the bindings the sum rests on are stored as it is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Set
from typing import TYPE_CHECKING

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.coordinator.reach import ReachMemo
from lensemble_flwr.errors import FaultToleranceExceeded
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.protocol.round import RoundEvent

if TYPE_CHECKING:
    from lensemble_flwr.coordinator.modes import RoundMode


@dataclasses.dataclass(frozen=True)
class Look:
    """What one call of ``advance`` shows an exit rule."""

    attempt: Attempt
    mode: RoundMode
    config: LensembleConfig
    registry: ParticipantRegistry
    reach: ReachMemo  # what was derived from the peers before, reused when unchanged
    peers: Set[str]  # reachable now (and, when sampled, in the attempt's sample)
    available: int  # how many are reachable, sampled or not
    deadline_passed: bool  # the phase's deadline


@dataclasses.dataclass(frozen=True)
class ExitRule:
    """A phase's way out: ``rule(look)`` is True once ``event`` may fire."""

    event: RoundEvent
    rule: Callable[[Look], bool]


def shortfall(attempt: Attempt) -> str:
    """Why an attempt is short of its quorum, as far as the answers say: appended to its
    FaultToleranceExceeded, so that the run's final status names the cause."""
    parts = []
    if attempt.refused:
        peer, reason = min(attempt.refused.items())
        parts.append(f"{len(attempt.refused)} answered without an update (first, {peer}: {reason})")
    if attempt.rejected:
        parts.append(f"{attempt.rejected} messages rejected")
    return "; " + "; ".join(parts) if parts else ""


def quorum_reached(look: Look) -> bool:
    """OPEN's rule: K participants are ready.

    Raises:
        FaultToleranceExceeded: the open deadline passed short of K (or, sampled, with
            fewer than ``min-available`` reachable: no sample was drawn).
    """
    attempt, fed = look.attempt, look.config.federation
    look.mode.settle(attempt, look.peers, final=look.deadline_passed)
    ready = look.mode.ready(attempt, look.peers)
    if len(ready) >= fed.quorum:
        return True
    wanted = fed.min_available
    if look.deadline_passed and fed.sampled and attempt.sample is None and look.available < wanted:
        raise FaultToleranceExceeded(
            f"{look.available} participants reachable by the open deadline "
            f"({attempt.deadline_of('open')}), and a sampled "
            f"attempt draws none before min-available = {wanted} are (FedAvg's "
            "min_available_nodes)"
        )
    if look.deadline_passed:
        raise FaultToleranceExceeded(
            f"{len(ready)} of quorum {fed.quorum} participants ready by the open deadline "
            f"({attempt.deadline_of('open')}; {look.mode.readiness}), of {look.available} "
            "reachable"
        )
    return False


def collection_closed(look: Look) -> bool:
    """COLLECTING's rule: nobody eligible and reachable is still to deliver, or the
    deadline passed with K updates. Stores the registry (the bindings the sum rests on)
    before it says so.

    Raises:
        FaultToleranceExceeded: K updates can no longer arrive, or did not by the deadline.
    """
    attempt, quorum = look.attempt, look.config.federation.quorum
    eligible = look.mode.eligible(attempt)
    outstanding = look.reach.outstanding(attempt, eligible, look.peers)
    if outstanding and len(attempt.admitted) + len(outstanding) < quorum:
        raise FaultToleranceExceeded(
            f"{len(attempt.admitted)} updates and {len(outstanding)} reachable "
            f"participants left; quorum {quorum} cannot be met{shortfall(attempt)}"
        )
    if outstanding and not look.deadline_passed:
        return False
    if len(attempt.admitted) < quorum:
        when = "and nobody left to answer"
        if outstanding:  # name who kept the round waiting
            silent = sorted(outstanding)
            more = f" and {len(silent) - 3} more" if len(silent) > 3 else ""
            when = (
                f"by the collect deadline ({attempt.deadline_of('collect')}; no answer from "
                f"{', '.join(silent[:3])}{more})"
            )
        raise FaultToleranceExceeded(
            f"{len(attempt.admitted)} updates {when}, quorum {quorum}{shortfall(attempt)}"
        )
    look.registry.persist()  # the bindings this round's sum rests on
    return True


LEAVE_OPEN = ExitRule(RoundEvent.QUORUM_REACHED, quorum_reached)
"""OPEN -> COLLECTING once the quorum is ready."""

LEAVE_COLLECTING = ExitRule(RoundEvent.COLLECTION_CLOSED, collection_closed)
"""COLLECTING -> AGGREGATING once collection is complete (or at the deadline with K)."""
