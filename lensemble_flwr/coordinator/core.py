"""The round as values: begin, invite, receive, advance, conclude, abort.

A :class:`RoundCore` holds a run's committed state (:class:`~.commit.RunHead`), the
current attempt and the current round's manifest entries, and moves the attempt through
the round's states. It never touches a transport or a clock: who is reachable, what
arrived, whether a deadline passed and what time it is are handed in as values; a
masked round's unmask requests are handed out (:meth:`RoundCore.unmask`) and their
answers come back through :meth:`RoundCore.receive` like any message. The blocking
loop (:mod:`.driver`), Flower's ``configure_train``/``aggregate_train`` and the
shared-folder decider all drive it through :class:`~.coordinator.Coordinator`.

What a message may do is the mode's round table (:mod:`.admission`, :mod:`.modes`);
how a phase is left, its exit rules (:mod:`.exits`); what a commit writes, and in what
order, :mod:`.commit`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from lensemble_flwr.aggregation.fixed_point import AggregateSum
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.admission import (
    Verdict,
    admit,
    record_rejection,
    record_sample,
    rename_invitee,
)
from lensemble_flwr.coordinator.attempt import Attempt, RoundOutcome
from lensemble_flwr.coordinator.batch import Prepared
from lensemble_flwr.coordinator.commit import (
    CommitContext,
    HeldRun,
    commit_round,
    entry_of,
)
from lensemble_flwr.coordinator.deadlines import DeadlineTracker
from lensemble_flwr.coordinator.durable import mark_started
from lensemble_flwr.coordinator.envelope import Ingress
from lensemble_flwr.coordinator.exits import Look
from lensemble_flwr.coordinator.external_step import check_adoptable, take_external_step
from lensemble_flwr.coordinator.inputs import RoundInputs
from lensemble_flwr.coordinator.modes import PlaintextMode, RoundMode, UnmaskRound
from lensemble_flwr.coordinator.outcomes import RecentOutcomes
from lensemble_flwr.coordinator.reach import ReachMemo
from lensemble_flwr.coordinator.sampling import draw_sample, oversampled
from lensemble_flwr.coordinator.spent import SpentBudgets
from lensemble_flwr.errors import (
    ConfigError,
    FaultToleranceExceeded,
    IllegalTransition,
    LensembleError,
    Response,
    response_to,
)
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.protocol.messages import RoundClose, RoundOpen, WirePayload, from_wire
from lensemble_flwr.protocol.round import TERMINAL_STATES, RoundEvent, RoundMachine, RoundState
from lensemble_flwr.provenance.ledger import ExternalStep, RunManifest
from lensemble_flwr.transports.base import COORDINATOR, DeliveredFrom, FiledByTransport

# the coordinator's log: one name for the facade and the parts it is made of
log = logging.getLogger("lensemble_flwr.coordinator.coordinator")

_UNTYPED_INPUT_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,
    ArithmeticError,
)
"""What a malformed message could still raise past validation (see ``receive``)."""

_OLDER_ENTRIES_KEPT = 4
"""Update digests of earlier rounds' attempts kept in memory once read from the store (to
recognise replays of late updates without reading their entry again for each)."""


@dataclasses.dataclass(frozen=True)
class Concluded:
    """An attempt that reached CLOSED: what the caller announces and reports."""

    attempt: Attempt
    result: AggregateSum
    diagnostics: Mapping[str, float]
    close: RoundClose  # to announce
    failure: BaseException | None  # a step after the commit point failed: raise it


@dataclasses.dataclass
class Observers:
    """Who hears of what the core does (both may be None)."""

    on_round: Callable[[RoundOutcome], None] | None = None  # every outcome
    on_transition: Callable[[RoundMachine], None] | None = None  # every transition


class RoundCore:
    """A run's round steps, on values (see the module).

    Attributes:
        run: the run held in memory: its committed head, the current round's manifest
            entries, an external step (see :class:`~.commit.HeldRun`).
        attempt: the current (or last) attempt; None before the first.
        outcomes: every outcome reported, the latest few held.
    """

    def __init__(
        self,
        *,
        inputs: RoundInputs,
        store: Store,
        registry: ParticipantRegistry,
        mode: RoundMode,
        commit: CommitContext,
        run: HeldRun,
        outcomes: RecentOutcomes,
        observers: Observers,
    ) -> None:
        self.inputs, self.config = inputs, inputs.config
        self.store, self.registry, self.mode = store, registry, mode
        self._commit, self.run = commit, run
        self.outcomes, self.observers = outcomes, observers
        self.attempt: Attempt | None = None
        self.spent = SpentBudgets(  # read on first DP update
            commit.ledger.records, lambda: RunManifest.load(store).rounds
        )
        self.ingress = Ingress(
            config=self.config,
            run_id=inputs.run_id,
            registry=registry,
            admitted_digests=self.admitted_digests,
            spent_before=self.spent.before,
        )
        self.grace = 0.0  # extra seconds on the next attempt's deadlines
        self.deadlines = DeadlineTracker(self.config.federation)  # fixed or adaptive
        self._reach = ReachMemo()  # what invite and advance derived from the peers
        self._signed_from: dict[str, int] = {}  # participant -> the node it last signed from
        self._older_digests: dict[tuple[int, int], Mapping[str, str] | None] = {}
        self._oversampling_warned = False

    # -- values ------------------------------------------------------------------------
    def current(self) -> Attempt:
        """The current attempt.

        Raises:
            IllegalTransition: no attempt has begun.
        """
        if self.attempt is None:
            raise IllegalTransition("no round attempt has begun")
        return self.attempt

    def next_attempt(self) -> int:
        """The attempt number the current round's next attempt will carry."""
        r = self.run.head.state.next_round
        return 1 + sum(1 for e in self.run.manifest.rounds if e.round == r)

    def round_open(self, attempt: int) -> RoundOpen:
        """The plaintext RoundOpen of attempt ``attempt`` of the next round."""
        return self.inputs.round_open(self.run.head.state, attempt)

    # -- the steps ---------------------------------------------------------------------
    def begin(self, *, now: float, declared: int | None = None) -> Attempt:
        """Start the next attempt of the current round (OPEN) at time ``now``.

        ``declared``: how many participants the federation declares, if it does.

        Raises:
            IllegalTransition: the previous attempt has not ended.
            LedgerError: the attempt was already started once.
            ConfigError: ``declared`` is below the quorum (nothing is started).
        """
        if self.attempt is not None and self.attempt.phase not in TERMINAL_STATES:
            raise IllegalTransition(
                f"round {self.attempt.round} attempt {self.attempt.number} has not ended"
            )
        _check_quorum_reachable(self.config, declared)
        state, number = self.run.head.state, self.next_attempt()
        mark_started(self.store, state.next_round, number, self.run.external_step)
        attempt = Attempt(
            machine=RoundMachine(state.next_round, number),
            state=state,
            external_step=self.run.external_step,
            round_open=self.round_open(number),
            started=now,
            grace=self.grace,
            deadlines=self.deadlines.next(),
            transform=self.inputs.transform(state),
            sketch_fingerprint=self.inputs.fingerprint(state),
        )
        self.grace = 0.0
        self._reach.forget()  # its keys name the previous attempt, which can go now
        self.attempt = attempt
        self.run.stepped_from = None  # adopt() is refused from now on: θ_{t-1}, m_{t-1} go
        self.mode.begin(attempt)
        return attempt

    def invite(self, reachable: Iterable[str]) -> list[tuple[str, RoundOpen]]:
        """The RoundOpens the current attempt owes ``reachable`` participants now.

        Raises:
            IllegalTransition: the attempt is neither OPEN nor COLLECTING.
        """
        attempt = self.current()
        if attempt.phase not in (RoundState.OPEN, RoundState.COLLECTING):
            raise IllegalTransition(f"the round is {attempt.phase.value}: nobody to invite")
        peers = self._sampled(attempt, self._reach.peer_set(reachable))
        self.mode.settle(attempt, peers, final=False)
        # a plaintext call that invited nobody invites nobody again on the same inputs
        key = self._reach.invite_key(attempt, peers)
        plaintext = isinstance(self.mode, PlaintextMode)
        if plaintext and self._reach.invite_idle(key):
            return []
        invitations = []
        for peer in sorted(peers):
            message = self.mode.invitation(attempt, peer)
            if message is not None:
                invitations.append((peer, message))
        if plaintext and not invitations:
            self._reach.invited_nobody(key)
        return invitations

    def _sampled(self, attempt: Attempt, reachable: frozenset[str]) -> frozenset[str]:
        """The reachable participants the attempt may invite: all of them, or — when
        rounds are sampled — those in its sample (drawn once: :mod:`.sampling`)."""
        fed = self.config.federation
        if not fed.sampled:
            return reachable
        if attempt.sample is None:
            drawn = draw_sample(reachable, attempt.round, attempt.number, fed)
            if drawn is None:
                return frozenset()  # a sample below K could only abort: wait for more peers
            record_sample(attempt, drawn)
            self._warn_if_oversampled(len(drawn), len(reachable))
            if len(drawn) < fed.quorum:
                return frozenset()  # nobody trains for an attempt that can only abort
            log.info(
                "round %d attempt %d: sampled %d of %d reachable participants",
                attempt.round,
                attempt.number,
                len(drawn),
                len(reachable),
            )
        assert attempt.sample is not None
        return self._reach.sampled(reachable, attempt.sample)

    def _warn_if_oversampled(self, drawn: int, reachable: int) -> None:
        """Warn (once) when a fixed sample asks more participants than the privacy plan
        assumes (:func:`~.sampling.oversampled`)."""
        fed, privacy = self.config.federation, self.config.privacy
        if self._oversampling_warned or not oversampled(drawn, reachable, fed, privacy):
            return
        self._oversampling_warned = True
        log.warning(
            "a round asks %d of %d participants (%.3g of them), more than sample-fraction "
            "%g, which the privacy plan assumes: participants will spend their budgets "
            "sooner than dp-overrun %g says (raise sample-fraction, or plan with more "
            "releases)",
            drawn,
            reachable,
            drawn / reachable,
            fed.sample_fraction,
            privacy.dp_overrun,
        )

    def rename(self, address: str, participant: str) -> bool:
        """The peer addressed as ``address`` is participant ``participant``; False (nothing
        changes) when ``address`` already answered this attempt under that name."""
        attempt = self.attempt
        if attempt is None or attempt.phase in TERMINAL_STATES:
            return True
        if address in attempt.admitted or address in attempt.refused:
            log.warning(
                "round %d: %s already answered under that name; it cannot become %s",
                attempt.round,
                address,
                participant,
            )
            return False
        rename_invitee(attempt, address, participant)
        log.info("round %d: %s is participant %s", attempt.round, address, participant)
        return True

    def receive(
        self, payload: WirePayload | None, *, prepared: Prepared | None = None
    ) -> Verdict | None:
        """Validate one payload and admit it (see ``Coordinator.receive``)."""
        if payload is None:
            return None
        attempt = self.current()
        try:
            message, fields = (from_wire(payload), None) if prepared is None else prepared.result()
            filed = isinstance(payload, FiledByTransport)
            verdict = admit(
                attempt,
                message,
                self.ingress,
                self.mode.admission,
                fields,
                filed_by_transport=filed,
                vouched=filed
                and payload.node is not None
                and self._signed_from.get(message.sender) == payload.node,
            )
            if (
                isinstance(payload, DeliveredFrom)
                and payload.node is not None
                and verdict is not Verdict.LATE  # (an unknown sender's late one is unchecked)
            ):
                # admitted, so signed if the participant signs: its node has proven the name
                self._signed_from[payload.peer] = payload.node
            return verdict
        except LensembleError as exc:
            if response_to(exc) is not Response.REJECT_MESSAGE:
                raise
            log.warning(
                "round %d: message rejected (%s): %s", attempt.round, type(exc).__name__, exc
            )
            keyless = isinstance(payload, Mapping) and not self.registry.has_key(
                str(payload.get("participant_id"))
            )  # (not a mapping at all: rejected as malformed, answering for nobody)
            record_rejection(attempt, payload, exc, keyless=keyless)
            return None
        except _UNTYPED_INPUT_ERRORS as exc:
            # A message that passed validation and still tripped something below: it is
            # rejected like any bad message (and logged with its traceback, as a bug),
            # never a crash of the coordinator. I/O errors are not the message's: they
            # propagate.
            log.exception("round %d: message rejected (untyped error)", attempt.round)
            record_rejection(attempt, payload, exc)
            return None

    def advance(self, reachable: Iterable[str], *, deadline_passed: bool) -> bool:
        """Leave the current phase if the mode's exit rule for it holds; True if it did.

        Raises:
            FaultToleranceExceeded: the quorum was not, or can no longer be, met.
            IllegalTransition: the round table has no exit from the attempt's state.
        """
        attempt, fed = self.current(), self.config.federation
        peers: set[str] | frozenset[str] = self._reach.peer_set(reachable)
        available = len(peers)
        if fed.sampled:  # only the sample counts (none before it is drawn)
            peers = set() if attempt.sample is None else self._reach.sampled(peers, attempt.sample)
        if attempt.sample is not None and len(attempt.sample) < fed.quorum:
            raise FaultToleranceExceeded(  # every Poisson draw was below K: none was invited
                f"the attempt's sample has {len(attempt.sample)} participants, "
                f"quorum {fed.quorum}"
            )
        phase = self.mode.table.get(attempt.phase)
        if phase is None or phase.exit is None:
            raise IllegalTransition(f"the round is {attempt.phase.value}: nothing to advance")
        look = Look(
            attempt, self.mode, self.config, self.registry, self._reach, peers, available,
            deadline_passed,
        )  # fmt: skip
        if not phase.exit.rule(look):
            return False
        self.fire(attempt, phase.exit.event)
        return True

    def aggregating(self) -> Attempt:
        """The current attempt, which must be AGGREGATING.

        Raises:
            IllegalTransition: it is not (nothing changes).
        """
        attempt = self.current()
        if attempt.phase is not RoundState.AGGREGATING:
            raise IllegalTransition(f"cannot conclude a round that is {attempt.phase.value}")
        return attempt

    def survivor_check(self) -> UnmaskRound | None:
        """The survivor check an AGGREGATING masked attempt in which somebody dropped
        needs answered before its unmask requests (None otherwise). The attestations are
        :meth:`receive`'d as they come; :meth:`unmask` follows.

        Raises:
            IllegalTransition: the attempt is not AGGREGATING (nothing changes).
            LensembleError: the sum cannot be revealed (the caller aborts).
        """
        return self.mode.check(self.aggregating())

    def unmask(self) -> UnmaskRound | None:
        """The unmask requests an AGGREGATING attempt needs answered before its sum is
        revealed (a masked round), or None (a plaintext one). The answers are
        :meth:`receive`'d as they come; :meth:`conclude` follows.

        Raises:
            IllegalTransition: the attempt is not AGGREGATING (nothing changes).
            LensembleError: the requests could not be formed (the caller aborts).
        """
        return self.mode.unmask(self.aggregating())

    def conclude(self) -> Concluded | LensembleError:
        """AGGREGATING → ALIGNING → COMMITTING → CLOSED (:mod:`.commit`); the error that
        stopped it before the commit point otherwise (the caller aborts with it).

        Raises:
            IllegalTransition: the attempt is not AGGREGATING (nothing changes).
        """
        attempt = self.aggregating()
        try:
            result = self.mode.reveal(attempt)
            self.fire(attempt, RoundEvent.SUM_REPRODUCED)
            mean = result.mean()
            diagnostics = self.inputs.diagnose(attempt.state, mean)
            self.fire(attempt, RoundEvent.DIAGNOSED)
            committed, failure = commit_round(
                self._commit, self.run, attempt, result, mean, diagnostics,
                self.observers.on_transition,
            )  # fmt: skip
        except LensembleError as exc:
            if attempt.phase in TERMINAL_STATES:
                self.spent.forget()  # committed: read the ledger again when next needed
                raise  # an observer of the commit raised it: the round stays committed
            return exc
        self.spent.committed(committed.record)
        self.spent.ended(committed.entry)  # updates it admitted beyond the contributors
        if attempt.round_time is not None:  # what the next adaptive deadlines follow
            self.deadlines.observe(attempt.round_time)
        close = RoundClose(
            run_id=self.inputs.run_id, round=attempt.round, sender=COORDINATOR,
            previous_hash=attempt.state.params_hash, global_hash=committed.state.params_hash,
            count=len(result.contributors), record_hash=committed.record.record_hash,
        )  # fmt: skip
        return Concluded(attempt, result, diagnostics, close, failure)

    def abort(self, error: LensembleError, *, now: float) -> RoundOutcome:
        """End the current attempt ABORTED with ``error``; the global state is untouched."""
        attempt = self.current()
        reason = f"{type(error).__name__}: {error}"
        self.fire(attempt, RoundEvent.ABORT, reason=reason)
        self.deadlines.aborted()  # its retry waits the cap (adaptive deadlines)
        log.warning("round %d attempt %d ABORTED: %s", attempt.round, attempt.number, reason)
        # kept in the outcome without its traceback: its frames hold the attempt, the sum
        # and the model (kept outcomes would pin them, and the sum's buffers, for good)
        outcome = self.outcome(attempt, None, {}, error.with_traceback(None), now=now)
        entry = entry_of(attempt, None, {}, reason, secure_sum=self.mode.secure_sum)
        self.run.manifest = self.run.manifest.with_round(self.store, entry)
        self.spent.ended(entry)  # what its admitted updates claimed: charged all the same
        self.report(outcome)
        return outcome

    def adopt(self, params: Mapping[str, np.ndarray]) -> ExternalStep | None:
        """Train the next round from ``params`` (see ``Coordinator.adopt``).

        Raises:
            IllegalTransition, ParameterMismatch, CheckpointIntegrityError, StoreError:
                as ``Coordinator.adopt`` (nothing changes).
        """
        committed = self.run.head.state
        check_adoptable(committed.params, params)
        state = self.inputs.pin(committed.round, params)  # a copy, hashed once
        step = self.run.external_step
        if step is not None:
            if state.params_hash == step.adopted_hash:
                return step
            raise IllegalTransition(
                f"round {committed.next_round} already trains from an adopted model "
                f"({step.adopted_hash[:12]}…); another would release the aggregate twice"
            )
        attempt = self.attempt
        if attempt is not None and attempt.round == committed.next_round:
            raise IllegalTransition(
                f"adopt: round {attempt.round} attempt {attempt.number} already started "
                "from the committed model"
            )
        stepped_from = self.run.stepped_from
        if stepped_from is None or attempt is None:
            raise IllegalTransition(
                "adopt: this coordinator committed no round since it started; only the "
                "model a round just committed can be changed"
            )
        if state.params_hash == committed.params_hash:
            return None
        momentum, step = take_external_step(
            self.store, committed, stepped_from, state, self.config.outer
        )
        self.run.head = dataclasses.replace(self.run.head, state=state, momentum=momentum)
        self.run.external_step = step
        log.info(
            "round %d trains from a model changed after the previous commit (change norm "
            "%.4g; recorded as its external step)",
            state.next_round,
            step.change_norm,
        )
        return step

    # -- reporting ---------------------------------------------------------------------
    def fire(self, attempt: Attempt, event: RoundEvent, *, reason: str | None = None) -> None:
        """Move ``attempt`` on ``event`` and tell the transition observer."""
        attempt.machine.fire(event, reason=reason)
        if self.observers.on_transition is not None:
            self.observers.on_transition(attempt.machine)

    def outcome(
        self,
        attempt: Attempt,
        result: AggregateSum | None,
        diagnostics: Mapping[str, float],
        error: LensembleError | None,
        *,
        now: float,
    ) -> RoundOutcome:
        """How ``attempt`` ended, as of time ``now``."""
        contributors = result.contributors if result is not None else ()
        return RoundOutcome(
            round=attempt.round,
            attempt=attempt.number,
            state=attempt.phase,
            error=error,
            count=len(contributors),
            contributors=contributors,
            late=tuple(sorted(attempt.late)),
            rejected=attempt.rejected,
            global_hash=self.run.head.state.params_hash,
            diagnostics=dict(diagnostics),
            elapsed=now - attempt.started,
            path=attempt.path(),
            refused=tuple(sorted(set(attempt.refused) & attempt.invited - attempt.admitted)),
            deadlines=attempt.deadlines if attempt.waiting_since is not None else None,
            round_time=attempt.round_time,
        )

    def report(self, outcome: RoundOutcome) -> None:
        """Keep ``outcome`` and hand it to the round observer."""
        self.outcomes.append(outcome)
        if self.observers.on_round is not None:
            self.observers.on_round(outcome)

    def admitted_digests(self, round: int, attempt: int) -> Mapping[str, str] | None:
        """The update digests the manifest records as admitted in ``(round, attempt)``."""
        for entry in self.run.manifest.rounds:  # the current round's entries
            if (entry.round, entry.attempt) == (round, attempt):
                return entry.update_digests
        if round >= self.run.head.state.next_round:
            return None  # not recorded yet, so not in the store either
        key = (round, attempt)
        if key not in self._older_digests:  # read once; the last few are kept
            if len(self._older_digests) >= _OLDER_ENTRIES_KEPT:
                del self._older_digests[next(iter(self._older_digests))]
            entry = RunManifest.entry(self.store, round, attempt)
            self._older_digests[key] = entry.update_digests if entry is not None else None
        return self._older_digests[key]


def _check_quorum_reachable(config: LensembleConfig, declared: int | None) -> None:
    """Refuse to begin when the federation declares fewer participants than the quorum.

    Raises:
        ConfigError: no round could ever close.
    """
    fed = config.federation
    if declared is not None and declared < fed.quorum:
        key = (
            "secagg-threshold"
            if fed.secagg_threshold > fed.min_participants
            else ("min-participants")
        )
        raise ConfigError(
            key,
            f"the quorum is K = {fed.quorum} (min-participants {fed.min_participants}, "
            f"secagg-threshold {fed.secagg_threshold}) but the federation has "
            f"{declared} participants: no round could ever close",
        )

