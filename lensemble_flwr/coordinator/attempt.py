"""What one round attempt accumulates while it runs, and how it ended.

An :class:`Attempt` is created when an attempt starts and discarded when it ends; nothing
in it outlives the attempt except what the commit writes (checkpoint, ledger record,
manifest entry). :class:`RoundOutcome` is the summary every caller sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from lensemble_flwr.aggregation.fixed_point import Aggregator
from lensemble_flwr.coordinator.deadlines import Phase, PhaseDeadlines
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.protocol.messages import RoundOpen, Update
from lensemble_flwr.protocol.round import RoundMachine, RoundState, TerminalState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import ExternalStep
from lensemble_flwr.secagg.protocol import Member


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """How one round attempt ended (also recorded in the run manifest).

    ``state`` is the attempt's terminal state: CLOSED or ABORTED.
    """

    round: int
    attempt: int
    state: TerminalState
    error: LensembleError | None
    count: int
    contributors: tuple[str, ...]
    late: tuple[str, ...]
    rejected: int
    global_hash: str
    diagnostics: Mapping[str, float]
    elapsed: float
    path: tuple[RoundState, ...] = ()
    refused: tuple[str, ...] = ()
    """Invited participants that answered without contributing (a refusal, an error
    reply, a reply that is no update, an update rejected at ingress), or that the
    SuperLink reported unavailable."""
    deadlines: PhaseDeadlines | None = None
    """The open and collect deadlines the attempt waited for (None: a feeder that hands
    in collected batches waits for none of its own)."""
    round_time: float | None = None
    """Seconds from the start of its wait to its last admitted update (None: none was
    admitted while it waited); what adaptive deadlines follow."""

    @property
    def reason(self) -> str | None:
        return None if self.error is None else f"{type(self.error).__name__}: {self.error}"


@dataclasses.dataclass
class Attempt:
    """Everything one round attempt accumulates.

    Created by the core as the attempt begins; from then on only the functions of
    :mod:`.admission` write it: the handlers of the round tables (:mod:`.admission`,
    :mod:`.modes`) for each admitted message, and the named writers for what is not a
    message — an invitation, the attempt's sample, a rename, a rejected message, the
    aggregator and a masked round's members. The state machine (``machine``) moves only
    by :meth:`~lensemble_flwr.protocol.round.RoundMachine.fire`.
    """

    machine: RoundMachine
    state: GlobalState  # the pinned global state the attempt runs on
    external_step: ExternalStep | None  # set when that state was changed after its commit
    round_open: RoundOpen  # the attempt's RoundOpen, before per-recipient changes
    started: float  # on the coordinator's clock
    grace: float = 0.0  # extra seconds on the open and collect deadlines (a cold start)
    deadlines: PhaseDeadlines | None = None  # what it waits for (fixed or adaptive)
    waiting_since: float | None = None  # when its wait began, on the coordinator's clock
    round_time: float | None = None  # seconds from then to its last admitted update
    aggregator: Aggregator | None = None  # None until the mode can build it
    transform: Callable[[Update], Update] | None = None  # the research harness, if any
    sketch_fingerprint: str | None = None  # gauge alignment: the round's sketch
    members: list[Member] | None = None  # a masked round's member set, once fixed
    members_sent: set[str] = dataclasses.field(default_factory=set)
    invited: set[str] = dataclasses.field(default_factory=set)
    sample: frozenset[str] | None = None  # a sampled attempt's participants, once drawn
    admitted: set[str] = dataclasses.field(default_factory=set)
    roots: dict[str, str | None] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    epsilon: dict[str, float | None] = dataclasses.field(default_factory=dict)
    update_digests: dict[str, str] = dataclasses.field(default_factory=dict)
    late: set[str] = dataclasses.field(default_factory=set)
    rejected: int = 0
    endorsements: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    """Participant -> (record hash, signature): the endorsements admitted with its messages."""

    @property
    def round(self) -> int:
        return self.machine.round

    @property
    def number(self) -> int:
        """The attempt number (1 for a round's first attempt)."""
        return self.machine.attempt

    @property
    def phase(self) -> RoundState:
        return self.machine.state

    def start_waiting(self, now: float) -> PhaseDeadlines:
        """Its wait begins at ``now`` (its deadlines run from here): its deadlines."""
        self.waiting_since = now
        if self.deadlines is None:
            raise ValueError("an attempt that waits needs its deadlines")
        return self.deadlines

    def note_admitted(self, now: float) -> None:
        """An update was admitted at ``now``: the round's time so far."""
        if self.waiting_since is not None:
            self.round_time = max(0.0, now - self.waiting_since)

    def deadline_of(self, phase: Phase) -> str:
        """``phase``'s deadline, for a reason: seconds, key, grace (see PhaseDeadlines)."""
        if self.deadlines is None:
            return "no deadline of its own"
        return self.deadlines.describe(phase, self.grace)

    def path(self) -> tuple[RoundState, ...]:
        """Every state the attempt has been in, in order."""
        return (RoundState.OPEN, *(after for _, _, after in self.machine.history))
