"""The round state machine: its states, the events that move it, and the one table.

Every legal transition lives in :data:`TRANSITIONS`, one literal table (the idea of
h11's ``_state.py``). :meth:`RoundMachine.fire` is the only way a round changes
state; an event the table has no entry for raises :class:`IllegalTransition` and
leaves the machine exactly as it was.

How an attempt ended is a :data:`TerminalState`: :class:`RoundState` restricted to
CLOSED and ABORTED. The run manifest, the shared-folder outcomes and the run summaries
use it too, so a round's end has one spelling in the code; on disk it is the state's
value (``"closed"``, ``"aborted"``), as it always was.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, get_args

from lensemble_flwr.errors import IllegalTransition


class RoundState(str, enum.Enum):
    """Lifecycle of one outer round."""

    OPEN = "open"
    COLLECTING = "collecting"
    AGGREGATING = "aggregating"
    ALIGNING = "aligning"
    COMMITTING = "committing"
    CLOSED = "closed"
    ABORTED = "aborted"

    def __str__(self) -> str:  # "closed", not "RoundState.CLOSED", in messages and logs
        return self.value


TerminalState = Literal[RoundState.CLOSED, RoundState.ABORTED]
"""How a round attempt ended: the type of every field that records it (a pydantic field
of this type reads and writes the plain strings ``"closed"`` and ``"aborted"``)."""
TERMINAL_STATES: frozenset[RoundState] = frozenset(get_args(TerminalState))


class RoundEvent(str, enum.Enum):
    """What moves a round from one state to the next."""

    QUORUM_REACHED = "quorum-reached"
    """K participants joined and bound a valid commitment."""
    COLLECTION_CLOSED = "collection-closed"
    """Every expected update arrived, or the collect deadline passed with a quorum."""
    SUM_REPRODUCED = "sum-reproduced"
    """The aggregate passed the determinism self-check."""
    DIAGNOSED = "diagnosed"
    """Aggregate-level diagnostics were computed (no per-participant transform)."""
    COMMITTED = "committed"
    """The outer step was applied and the new global state hash-committed."""
    ABORT = "abort"
    """The round is discarded; the global state does not change."""


_S, _E = RoundState, RoundEvent
TRANSITIONS: Mapping[tuple[RoundState, RoundEvent], RoundState] = MappingProxyType(
    {
        (_S.OPEN, _E.QUORUM_REACHED): _S.COLLECTING,
        (_S.COLLECTING, _E.COLLECTION_CLOSED): _S.AGGREGATING,
        (_S.AGGREGATING, _E.SUM_REPRODUCED): _S.ALIGNING,
        (_S.ALIGNING, _E.DIAGNOSED): _S.COMMITTING,
        (_S.COMMITTING, _E.COMMITTED): _S.CLOSED,
        (_S.OPEN, _E.ABORT): _S.ABORTED,
        (_S.COLLECTING, _E.ABORT): _S.ABORTED,
        (_S.AGGREGATING, _E.ABORT): _S.ABORTED,
        (_S.ALIGNING, _E.ABORT): _S.ABORTED,
        (_S.COMMITTING, _E.ABORT): _S.ABORTED,
    }
)


def next_state(state: RoundState, event: RoundEvent) -> RoundState:
    """The state ``event`` leads to from ``state``; IllegalTransition if there is none."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"no transition from {state.value!r} on {event.value!r}") from None


@dataclasses.dataclass
class RoundMachine:
    """The state of one round attempt. Created OPEN; ends CLOSED or ABORTED."""

    round: int
    attempt: int = 1
    state: RoundState = RoundState.OPEN
    history: list[tuple[RoundState, RoundEvent, RoundState]] = dataclasses.field(
        default_factory=list
    )
    abort_reason: str | None = None

    def fire(self, event: RoundEvent, *, reason: str | None = None) -> RoundState:
        """Apply ``event``; raise IllegalTransition (state unchanged) if it is not legal."""
        new = next_state(self.state, event)
        self.history.append((self.state, event, new))
        self.state = new
        if event is RoundEvent.ABORT:
            self.abort_reason = reason
        return new


def transition_diagram() -> str:
    """A Mermaid state diagram generated from :data:`TRANSITIONS` (used in the docs)."""
    lines = ["stateDiagram-v2", f"    [*] --> {RoundState.OPEN.name}"]
    for (source, event), target in TRANSITIONS.items():
        lines.append(f"    {source.name} --> {target.name}: {event.value}")
    lines += [f"    {s.name} --> [*]" for s in RoundState if s in TERMINAL_STATES]
    return "\n".join(lines)
