"""The coordinator: drives rounds, holds the canonical global state, runs the outer step.

A round attempt, in order::

    OPEN         invite every reachable participant (and any that appears while the
                 round is open); leave once K = max(min_participants, secagg_threshold)
                 are ready, or abort at the open timeout
    COLLECTING   admit updates until every eligible participant delivered (or became
                 unreachable), or the collect deadline; the contributing set freezes here
    AGGREGATING  reveal the exact sum; self-check, one re-sum on a mismatch
    ALIGNING     aggregate-level diagnostics only
    COMMITTING   outer step, checkpoint, ledger record, manifest entry — then, and only
                 then, the new global state replaces the old one in memory
    CLOSED       RoundClose announced (a failure to announce is logged, never undoes it)

:class:`Coordinator` is a facade over the parts that do this:

* :mod:`.core` — the round as values (begin, invite, receive, advance, conclude, abort);
  no transport, no clock;
* :mod:`.driver` — the blocking loop over a transport, and every transport call;
* :mod:`.admission` (with :mod:`.envelope`, :mod:`.exits`, :mod:`.modes`) — one round
  table per mode: which message each state admits, and how each state is left;
* :mod:`.sampling` — who a sampled attempt invites, as a pure function;
* :mod:`.commit` — the commit sequence, and the one rule after its commit point;
* :mod:`.create` and :mod:`.recovery` — a new run's first checkpoint; a stored run read
  back.

Every feeder drives the same steps — :meth:`Coordinator.begin_attempt`, :meth:`invite`,
:meth:`receive`, :meth:`advance`, :meth:`conclude` — the blocking loop (:meth:`run`, over
a transport: in-process, a Flower Grid), Flower's stock ``configure_train`` /
``aggregate_train`` and the shared-folder decider (:meth:`conclude_collected`, over a
batch that was collected some other way).

Any typed error on the way aborts the attempt with the global state untouched; what
happens next (retry the round, stop the federation, or just drop the message) is looked
up in :data:`lensemble_flwr.errors.RESPONSES`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import numpy as np

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.admission import Verdict
from lensemble_flwr.coordinator.attempt import Attempt, RoundOutcome
from lensemble_flwr.coordinator.batch import Prepared, prepare_batch
from lensemble_flwr.coordinator.core import RoundCore
from lensemble_flwr.coordinator.create import (
    Wiring,
    create_core,
    fixed_point_aggregator,
    holds_a_run,
    resume_core,
)
from lensemble_flwr.coordinator.driver import WRITES_PREPARED, Driver
from lensemble_flwr.coordinator.envelope import signed_for_its_name
from lensemble_flwr.coordinator.modes import AggregatorFactory, RoundMode, require_exchange
from lensemble_flwr.coordinator.recovery import INTERRUPTED
from lensemble_flwr.coordinator.sampling import poisson_draw
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.messages import RoundOpen, Update, WirePayload
from lensemble_flwr.protocol.round import RoundMachine, RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import (
    ENDORSED_BY_NEXT_ROUND,
    EndorsementPolicy,
    ExternalStep,
    RunManifest,
)
from lensemble_flwr.transports.base import Transport

__all__ = [
    "INTERRUPTED",
    "WRITES_PREPARED",
    "AggregatorFactory",
    "Coordinator",
    "RoundOutcome",
    "fixed_point_aggregator",
    "holds_a_run",
    "poisson_draw",
]


class Coordinator(Driver):
    """Drives rounds, holds the canonical global state, runs the outer optimizer.

    Who takes part — bindings, identity keys, masked-round membership — is in
    :attr:`registry` (:class:`~lensemble_flwr.identity.registry.ParticipantRegistry`).
    ``Coordinator(...)`` (or :meth:`create`) starts a new run; :meth:`resume` continues a
    stored one.

    Args:
        config: the federation's config.
        transport: the coordinator's end of any :class:`Transport`; needed by the blocking
            loop (:meth:`run`), not by a feeder that hands in collected batches.
        initial_params: θ_0, the shared groups' initial arrays (float).
        store: the run directory's artifact store (checkpoints, ledger, manifest).
        run_id: names the run in every message; messages of other runs are rejected.
        aggregator_factory: builds a plaintext round's :class:`Aggregator` from the global
            params, the aggregation config and the self-check seed.
        on_round: called with every :class:`RoundOutcome`, closed or aborted.
        update_transform: a coordinator-side transform of each individual plaintext update
            before it is summed (a research harness); refused with ``ConfigError`` when
            the config clips, noises, quantizes or masks releases.
        gauge: the model's gauge adapter and pinned probe. With it, RoundOpen announces
            the probe and every round records ``frame_drift``; ``gauge-align`` requires
            it (updates must carry the round's sketch fingerprint).
        identities: an allow-list of participant id → OpenSSH public identity key. With
            it, only listed participants may join, each with its listed key. Without it,
            a participant registers its key with its first Commitment. Either way, a
            participant with a registered key must sign every message with it.
        clock: seconds for deadlines and timings (default: the transport's clock, or
            ``time.monotonic`` without a transport).
        on_transition: called with the attempt's :class:`RoundMachine` once the blocking
            loop delivered its first RoundOpens (the attempt is OPEN) and after every
            transition — an
            observation point for tests and fault drills (also settable later, as the
            attribute of the same name). What it raises propagates: a drill's crash.
        endorsement: how the run's records are endorsed by the participants they name,
            recorded in the manifest header (docs/recovery.md): ``"next-round"`` (by
            their Commitments and Updates of the round after, the default) or
            ``"on-write"`` (a writer that is itself a participant endorses each record
            as it writes it: the shared folder).
    """

    def __init__(
        self,
        config: LensembleConfig,
        *,
        transport: Transport | None = None,
        initial_params: Mapping[str, np.ndarray],
        store: Store,
        run_id: str = "lensemble-run",
        aggregator_factory: AggregatorFactory = fixed_point_aggregator,
        on_round: Callable[[RoundOutcome], None] | None = None,
        update_transform: Callable[[Update], Update] | None = None,
        gauge: GaugeSetup | None = None,
        identities: Mapping[str, str] | None = None,
        clock: Callable[[], float] | None = None,
        on_transition: Callable[[RoundMachine], None] | None = None,
        endorsement: EndorsementPolicy = ENDORSED_BY_NEXT_ROUND,
    ) -> None:
        wiring = Wiring(
            config, store, aggregator_factory, update_transform, gauge, identities,
            on_round, on_transition, endorsement,
        )  # fmt: skip
        self._compose(create_core(wiring, run_id, initial_params), transport, clock)

    @classmethod
    def resume(
        cls,
        config: LensembleConfig,
        *,
        transport: Transport | None = None,
        store: Store,
        aggregator_factory: AggregatorFactory = fixed_point_aggregator,
        on_round: Callable[[RoundOutcome], None] | None = None,
        update_transform: Callable[[Update], Update] | None = None,
        gauge: GaugeSetup | None = None,
        identities: Mapping[str, str] | None = None,
        check: Literal["full", "chain"] = "full",
        clock: Callable[[], float] | None = None,
        on_transition: Callable[[RoundMachine], None] | None = None,
        follower: LedgerFollower | None = None,
    ) -> Coordinator:
        """Continue the run held in ``store`` after the coordinator stopped (or crashed).

        The resumed coordinator starts from the last CLOSED round: the newest ledger
        record's checkpoint (params and momentum), the ledger head, the participant
        registry and the attempt counter all come from the store (see
        :mod:`.recovery`). The round that was in flight is retried under a new attempt
        number.

        ``check="full"`` verifies the whole run first (every record and every checkpoint,
        as :func:`~lensemble_flwr.provenance.verify.verify`); ``check="chain"`` verifies
        the records' hash chain and only the checkpoint it resumes from — for a caller
        that resumes every round (the shared-folder runner), where a full check would make
        a run cost quadratic time. With ``follower`` (kept by the caller between resumes of
        the same run), only what was stored since its last resume is read and checked, as
        ``check="chain"`` checks it: a resume then costs the same in every round.

        Raises:
            StoreError: ``store`` holds no run.
            ConfigError: ``config`` is not the configuration the run was started with.
            LedgerError: the stored ledger, manifest or registry is inconsistent (the
                run is not resumed: ``lensemble-flwr verify`` names the broken link).
        """
        wiring = Wiring(
            config, store, aggregator_factory, update_transform, gauge, identities,
            on_round, on_transition,
        )  # fmt: skip
        coordinator = cls.__new__(cls)
        coordinator._compose(resume_core(wiring, check=check, follower=follower), transport, clock)
        return coordinator

    def _compose(
        self, core: RoundCore, transport: Transport | None, clock: Callable[[], float] | None
    ) -> None:
        """Wrap ``core``: the driver over ``transport``, and the facade's attributes."""
        if clock is None:
            clock = transport.now if transport is not None else time.monotonic
        super().__init__(core, transport, clock)
        self.config: LensembleConfig = core.config
        self.store: Store = core.store
        self.registry = core.registry
        self.run_id: str = core.inputs.run_id
        self.noise_multiplier: float = core.inputs.noise_multiplier
        self.outcomes = core.outcomes
        self.mode: RoundMode = core.mode
        """The kind of round this federation runs (plaintext or masked)."""
        self._mode = core.mode  # (tests reach the mode under this name too)

    # -- observability -----------------------------------------------------------------
    @property
    def on_transition(self) -> Callable[[RoundMachine], None] | None:
        """Called with the attempt's machine after every transition (see the class)."""
        return self.core.observers.on_transition

    @on_transition.setter
    def on_transition(self, hook: Callable[[RoundMachine], None] | None) -> None:
        self.core.observers.on_transition = hook

    def round_state(self) -> RoundState:
        """State of the current (or last) round attempt; CLOSED before the first round."""
        return self.core.attempt.phase if self.core.attempt else RoundState.CLOSED

    @property
    def attempt(self) -> Attempt | None:
        """The current (or last) round attempt; None before the first."""
        return self.core.attempt

    def global_state(self) -> GlobalState:
        """The canonical committed global state (the state the next round starts from)."""
        return self.core.run.head.state

    def momentum(self) -> NamedArrays:
        """Copies of the outer optimizer's momentum."""
        return {n: a.copy() for n, a in self.core.run.head.momentum.items()}

    @property
    def manifest(self) -> RunManifest:
        """The run's manifest, every attempt of every round, as stored (read from the
        store: the coordinator keeps only the current round's entries in memory)."""
        return RunManifest.load(self.store)

    def next_attempt(self) -> int:
        """The attempt number the current round's next attempt will carry."""
        return self.core.next_attempt()

    def round_open_for(self, peer: str) -> RoundOpen:
        """The plaintext RoundOpen the next attempt sends to ``peer``."""
        return self.core.round_open(self.next_attempt()).model_copy(
            update={"needs_commitment": not self.registry.is_bound(peer)}
        )

    # -- the steps every feeder drives -------------------------------------------------
    def invite(self, reachable: Iterable[str]) -> list[tuple[str, RoundOpen]]:
        """The RoundOpens the current attempt owes ``reachable`` participants now (each
        one once; in a masked round, once more to members when the set is fixed). The
        caller delivers them (or already did, e.g. the shared folder's announcement).

        When rounds are sampled, only the attempt's sample is invited: it is drawn once,
        when at least ``min-available`` participants are reachable (:mod:`.sampling`).

        Raises:
            IllegalTransition: the attempt is neither OPEN nor COLLECTING.
        """
        return self.core.invite(reachable)

    def rename(self, address: str, participant: str) -> bool:
        """The transport learnt that the peer it addressed as ``address`` (a Flower node
        it had not heard from) is participant ``participant``: the current attempt's
        invitation and sample follow the participant's own name. False (nothing
        changes) when ``address`` already answered this attempt under that name: one
        peer may not contribute under two names."""
        return self.core.rename(address, participant)

    def proves_name(self, payload: WirePayload) -> bool:
        """Whether ``payload`` is signed as its sender's name requires (the key registered
        for it; see :func:`~.envelope.signed_for_its_name`): what a transport asks before
        it takes a node to be the participant it names. False before the first attempt,
        and for anything malformed; nothing changes."""
        attempt = self.core.attempt
        return attempt is not None and signed_for_its_name(attempt, payload, self.core.ingress)

    def receive(
        self, payload: WirePayload | None, *, prepared: Prepared | None = None
    ) -> Verdict | None:
        """Validate one payload and hand it to the mode's round table.

        Errors whose response is to reject the message are logged and counted (None is
        returned), and so is any untyped error a malformed message could still raise
        (logged with its traceback); every other typed error propagates, and the caller
        aborts the attempt or stops. ``prepared``: the payload already validated and its
        arrays hashed (or the error that raised), as :meth:`conclude_collected` does for a
        batch on threads.
        """
        return self.core.receive(payload, prepared=prepared)

    def advance(self, reachable: Iterable[str], *, deadline_passed: bool) -> bool:
        """Leave OPEN or COLLECTING if the phase's exit rule holds; True if it did.

        OPEN is left once K participants are ready; COLLECTING once no eligible,
        reachable participant is still to deliver, or at the deadline with a quorum
        (:mod:`.exits`).

        Raises:
            FaultToleranceExceeded: the phase's deadline passed (or the quorum can no
                longer be met) short of K.
            IllegalTransition: the attempt is in neither phase.
        """
        return self.core.advance(reachable, deadline_passed=deadline_passed)

    def conclude_collected(
        self, payloads: Iterable[WirePayload], reachable: Iterable[str]
    ) -> RoundOutcome:
        """Finish the current attempt on a complete batch of collected messages.

        For a feeder that collected the replies some other way (Flower's stock
        ``aggregate_train``, the shared-folder decider): every payload goes through the
        same admission step; the batch is all there is, so OPEN and COLLECTING end as at
        their deadlines, and the attempt concludes without an unmask exchange.

        Raises:
            ConfigError: the rounds are masked (nothing changes).
        """
        require_exchange(self.mode, None)
        peers = sorted(set(reachable))
        attempt = self.core.current()
        batch = list(payloads)
        try:
            for payload, prepared in zip(batch, prepare_batch(batch), strict=True):
                self.receive(payload, prepared=prepared)
            while attempt.phase in (RoundState.OPEN, RoundState.COLLECTING):
                self.advance(peers, deadline_passed=True)
        except LensembleError as exc:
            return self.abort(exc)
        return self.conclude(exchange=None)

    def adopt(self, params: Mapping[str, np.ndarray]) -> ExternalStep | None:
        """Train the next round from ``params``, a change to the model the last round
        committed made outside lensemble (a wrapping strategy's central noise); the
        round's manifest entries and ledger record carry the step (:mod:`.external_step`).

        Returns:
            The step (None when ``params`` is the committed model: nothing changes). The
            same ``params`` again returns the same step.

        Raises:
            IllegalTransition: no round was committed by this coordinator since it
                started (there is no step to change), an attempt of the round already
                started from the committed model, or the round already adopted other
                params (a second release of one aggregate).
            ParameterMismatch: ``params`` differs from the committed model in names,
                shapes or dtypes, or holds non-finite values.
            CheckpointIntegrityError, StoreError: the adopted checkpoint was not stored.
            In every case nothing changes.
        """
        return self.core.adopt(params)

    def grant_grace(self, seconds: float) -> None:
        """Extend the open and collect deadlines of the next attempt (only) by ``seconds``.

        For a cold start: the first messages of a run can wait on processes that are still
        starting (Ray actors, SuperNode ClientApp processes), which is not the
        participants' fault and should not abort the first round.
        """
        self.core.grace = max(0.0, float(seconds))

    def _current(self) -> Attempt:
        return self.core.current()
