"""The coordinator: one round loop driving the RoundState machine.

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

Which messages a state admits is one table (:mod:`.admission`); how a plaintext and a
masked round differ is one interface (:mod:`.modes`), chosen once per attempt. Every
feeder drives the same steps — :meth:`Coordinator.begin_attempt`, :meth:`invite`,
:meth:`receive`, :meth:`advance`, :meth:`conclude` — the blocking loop (:meth:`run`, over
a transport: in-process, a Flower Grid), Flower's stock ``configure_train`` /
``aggregate_train`` and the shared-folder decider (:meth:`conclude_collected`, over a
batch that was collected some other way).

Any typed error on the way aborts the attempt with the global state untouched; what
happens next (retry the round, stop the federation, or just drop the message) is looked
up in :data:`lensemble_flwr.errors.RESPONSES`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import numpy as np

from lensemble_flwr.aggregation.fixed_point import AggregateSum, Aggregator, FixedPointAggregator
from lensemble_flwr.artifacts.checkpoint import checkpoint_parts
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import derive_seed, poisson_sample, seeded_sample
from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.coordinator.admission import Ingress, Verdict, admit
from lensemble_flwr.coordinator.attempt import Attempt, RoundOutcome
from lensemble_flwr.coordinator.batch import Prepared, prepare_batch
from lensemble_flwr.coordinator.commit import entry_of, retain, write_commit
from lensemble_flwr.coordinator.durable import mark_started
from lensemble_flwr.coordinator.external_step import (
    SteppedFrom,
    check_adoptable,
    take_external_step,
)
from lensemble_flwr.coordinator.modes import (
    AggregatorFactory,
    Exchange,
    PlaintextMode,
    RoundMode,
    mode_for,
)
from lensemble_flwr.coordinator.outcomes import KEEP_OUTCOMES, RecentOutcomes
from lensemble_flwr.coordinator.outer_optimizer import outer_step, zero_momentum
from lensemble_flwr.coordinator.reach import ReachMemo
from lensemble_flwr.coordinator.recovery import (
    INTERRUPTED,
    record_interrupted,
    recover,
    recover_following,
)
from lensemble_flwr.errors import (
    ConfigError,
    FaultToleranceExceeded,
    ForgedMessage,
    IllegalTransition,
    LensembleError,
    ParameterMismatch,
    Response,
    StoreError,
    response_to,
)
from lensemble_flwr.gauge.runtime import (
    GaugeSetup,
    check_warm_start_of,
    drift_diagnostics,
    expected_fingerprint,
    harness_transform,
    require_setup,
)
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.params import NamedArrays, check_initial_groups
from lensemble_flwr.privacy.calibration import (
    noise_multiplier_of,
    releases_of,
    with_ingress_bound,
)
from lensemble_flwr.privacy.guarantee import guarantee_of
from lensemble_flwr.protocol.messages import (
    ControlMessage,
    MessageKind,
    RoundClose,
    RoundOpen,
    UnmaskRequest,
    Update,
    WirePayload,
    from_wire,
    kind_of,
)
from lensemble_flwr.protocol.round import TERMINAL_STATES, RoundEvent, RoundMachine, RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import GENESIS, ExternalStep, Ledger, RunManifest
from lensemble_flwr.transports.base import (
    COORDINATOR,
    STOCK_CLIENTAPP,
    BuffersSends,
    DeclaresFederation,
    DeliveredFrom,
    FiledByTransport,
    Transport,
)

__all__ = [
    "INTERRUPTED",
    "AggregatorFactory",
    "Coordinator",
    "RoundOutcome",
    "fixed_point_aggregator",
]

log = logging.getLogger(__name__)

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

_DISCOVERY_INTERVAL = 1.0
"""Seconds between looks for newly reachable participants while a round is OPEN."""

WRITES_PREPARED = 8
"""Store writes prepared as an attempt's instructions go out: a plaintext commit makes
six files (checkpoint, ledger record and its name, closing entry and its name, the
manifest entry's name) and the next attempt's marker one; more are made as needed."""

_OLDER_ENTRIES_KEPT = 4
"""Update digests of earlier rounds' attempts kept in memory once read from the store (to
recognise replays of late updates without reading their entry again for each)."""


def fixed_point_aggregator(
    template: Mapping[str, np.ndarray], config: AggregationConfig, check_seed: int
) -> Aggregator:
    """The default aggregator: the exact plaintext fixed-point sum."""
    return FixedPointAggregator(template, config, check_seed=check_seed)


POISSON_DRAWS = 100
"""Poisson draws an attempt makes (each from its own seed) before it gives up on K."""


def _answered_all_the_same(
    attempt: Attempt, payload: WirePayload, error: Exception, *, keyless: bool = False
) -> None:
    """A rejected update that the transport took from the invited node's own reply to
    this attempt (:class:`~lensemble_flwr.transports.base.DeliveredFrom`) is that node's
    answer all the same: it will not send another, so the round stops waiting for it, and
    the attempt records why it contributed nothing. Nothing else is changed (a rejection
    of anything else, or of a message whose sender no transport vouches for, still waits:
    in process anyone may write any sender into a payload).

    A signature failure answers for nobody (another node may have taken the name), with
    one exception: an update the transport made of a stock ClientApp's reply, from a
    participant with no key (``keyless``). Nothing such a node sends can ever be signed,
    so waiting for it (under ``require-signatures``) could only wait out the deadline."""
    if not isinstance(payload, DeliveredFrom) or kind_of(payload) is not MessageKind.UPDATE:
        return
    stock = tuple(payload.get("transforms") or ()) == (STOCK_CLIENTAPP,)
    if isinstance(error, ForgedMessage) and not (stock and keyless):
        return
    if (payload.round, payload.attempt) != (attempt.round, attempt.number):
        return
    if attempt.phase not in (RoundState.OPEN, RoundState.COLLECTING):
        return
    peer = payload.peer
    if peer not in attempt.invited or peer in attempt.admitted or peer in attempt.refused:
        return
    attempt.refused[peer] = f"RejectedUpdate: {type(error).__name__}: {str(error)[:500]}"


def _shortfall(attempt: Attempt) -> str:
    """Why an attempt is short of its quorum, as far as the answers say: appended to its
    FaultToleranceExceeded, so that the run's final status names the cause."""
    parts = []
    if attempt.refused:
        peer, reason = min(attempt.refused.items())
        parts.append(f"{len(attempt.refused)} answered without an update (first, {peer}: {reason})")
    if attempt.rejected:
        parts.append(f"{attempt.rejected} messages rejected")
    return "; " + "; ".join(parts) if parts else ""


def poisson_draw(reachable: set[str], rate: float, seed: int, quorum: int) -> list[str]:
    """The first of up to :data:`POISSON_DRAWS` Poisson samples of ``reachable`` (seeds
    derived from ``seed`` and the draw's number) with at least ``quorum`` participants: a
    short draw could only abort the attempt after its members trained and spent budget.
    The last draw if none is long enough."""
    drawn: list[str] = []
    for draw in range(POISSON_DRAWS):
        drawn = poisson_sample(reachable, rate, derive_seed(seed, "draw", draw), "sample")
        if len(drawn) >= quorum:
            break
    return drawn


def holds_a_run(store: Store) -> bool:
    """Whether ``store`` already holds a run (a manifest, or ledger records): a new
    coordinator refuses it, and only a resume may continue it."""
    return store.bound("ledger/") or store.bound("manifest")


class Coordinator:
    """Drives rounds, holds the canonical global state, runs the outer optimizer.

    Who takes part — bindings, identity keys, masked-round membership — is in
    :attr:`registry` (:class:`~lensemble_flwr.identity.registry.ParticipantRegistry`).

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
    ) -> None:
        for name, array in initial_params.items():
            if not np.issubdtype(np.asarray(array).dtype, np.floating):
                raise ParameterMismatch(f"{name}: initial params must be floating-point")
        check_initial_groups(initial_params, config.groups)
        check_warm_start_of(gauge, config, initial_params)
        if holds_a_run(store):
            raise StoreError(
                f"{store.root} already holds a run; use a fresh run directory, or "
                "Coordinator.resume to continue it"
            )
        self._setup(
            config, transport, store, run_id, aggregator_factory, on_round,
            update_transform, gauge, identities, clock, on_transition,
        )  # fmt: skip
        self._global = self._pin(0, {n: np.asarray(a) for n, a in initial_params.items()})
        self._momentum: NamedArrays = zero_momentum(self._global.params)
        initial = store.put_parts(checkpoint_parts(0, self._global.params, self._momentum))
        self._manifest = RunManifest(
            run_id=run_id,
            config=config.to_recorded(),
            root_seed=config.federation.root_seed,
            initial_params_hash=self._global.params_hash,
            initial_checkpoint=initial,
        )
        self._manifest.start(store)

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
        as :func:`~lensemble_flwr.provenance.ledger.verify`); ``check="chain"`` verifies
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
        manifest = follower.manifest_header() if follower else RunManifest.load(store)
        config.check_recorded(manifest.config)
        self = cls.__new__(cls)
        self._setup(
            config, transport, store, manifest.run_id, aggregator_factory, on_round,
            update_transform, gauge, identities, clock, on_transition,
        )  # fmt: skip
        if follower is not None:
            recovered = recover_following(store, follower)
            self._ledger = Ledger(store, head=follower.head)
        else:
            recovered = recover(store, manifest, check)
        self._global = self._pin(recovered.round, recovered.params, copy=False)
        self._momentum = recovered.momentum
        self._head_hash = recovered.head_hash
        self._external_step = recovered.external_step
        self.registry.restore()
        self._manifest = record_interrupted(
            store, recovered.manifest, self._global, recovered.external_step
        ).since(self._global.next_round)
        log.info(
            "resumed run %s at round %d (%d participants registered)",
            self.run_id,
            self._global.next_round,
            len(self.registry.commitments),
        )
        return self

    def _setup(
        self,
        config: LensembleConfig,
        transport: Transport | None,
        store: Store,
        run_id: str,
        aggregator_factory: AggregatorFactory,
        on_round: Callable[[RoundOutcome], None] | None,
        update_transform: Callable[[Update], Update] | None,
        gauge: GaugeSetup | None,
        identities: Mapping[str, str] | None,
        clock: Callable[[], float] | None,
        on_transition: Callable[[RoundMachine], None] | None,
    ) -> None:
        """The in-memory parts every coordinator starts with, new or resumed."""
        require_setup(config, gauge)
        if update_transform is not None and config.gauge.coordinator_harness:
            raise ConfigError(
                "update_transform", "gauge-coordinator-harness already transforms each update"
            )
        if update_transform is not None and config.protected_releases:
            raise ConfigError(
                "update_transform",
                f"a coordinator-side transform of individual updates cannot be combined "
                f"with {config.protected_releases}: it would see (or undo) what the "
                "participants protect; transform before release, on the participant",
            )
        self.config = config
        self.noise_multiplier = noise_multiplier_of(config)  # refuses a bad plan
        self._oversampling_warned = False
        self._privacy = (
            guarantee_of(
                config.privacy.dp_mode,
                self.noise_multiplier,
                config.federation.secagg_threshold,
                adjacency=config.privacy.dp_adjacency,
            )
            if self.noise_multiplier > 0
            else None
        )
        if config.privacy.calibrated:
            log.info(
                "noise-multiplier %.4g, calibrated to spend epsilon %g (delta %g) over "
                "%d releases (dp-rounds %d)",
                self.noise_multiplier,
                config.privacy.dp_epsilon,
                config.privacy.dp_delta,
                releases_of(config, config.privacy.dp_rounds),
                config.privacy.dp_rounds,
            )
        self.transport = transport
        self.store = store
        self.run_id = run_id
        self._update_transform = update_transform
        self._gauge = gauge
        self.registry = ParticipantRegistry(config, store, identities)
        self._signed_from: dict[str, int] = {}  # participant -> the node it last signed from
        self._mode: RoundMode = mode_for(
            with_ingress_bound(config),  # under local DP, the noise's reach is admitted
            self.registry,
            run_id=run_id,
            aggregator_factory=aggregator_factory,
        )
        self._ingress = Ingress(
            config=config,
            run_id=run_id,
            registry=self.registry,
            admitted_digests=self._admitted_digests,
        )
        self._on_round = on_round
        self.on_transition = on_transition
        if clock is None:
            clock = transport.now if transport is not None else time.monotonic
        self._clock = clock
        self._ledger = Ledger(store)
        self._head_hash = GENESIS
        self._attempt: Attempt | None = None
        # an attempt open_attempt() began and delivered (or the outcome it ended with),
        # which the next run_attempt continues instead of beginning another
        self._opened: Attempt | RoundOutcome | None = None
        self._reach = ReachMemo()  # what invite and advance derived from the peers
        self._older_digests: dict[tuple[int, int], Mapping[str, str] | None] = {}
        self.last_close: RoundClose | None = None
        self._grace = 0.0
        # every attempt's outcome by position, the latest few held (the manifest has all)
        self.outcomes = RecentOutcomes(max(KEEP_OUTCOMES, config.federation.max_round_attempts))
        self._stepped_from: SteppedFrom | None = None  # the last commit's θ_t, m_t
        self._external_step: ExternalStep | None = None  # how _global replaced a commit
        self._prune_from = 0  # the first round whose checkpoints retention still looks at

    # -- observability -----------------------------------------------------------------
    def round_state(self) -> RoundState:
        """State of the current (or last) round attempt; CLOSED before the first round."""
        return self._attempt.phase if self._attempt else RoundState.CLOSED

    @property
    def attempt(self) -> Attempt | None:
        """The current (or last) round attempt; None before the first."""
        return self._attempt

    def global_state(self) -> GlobalState:
        """The canonical committed global state (the state the next round starts from)."""
        return self._global

    def momentum(self) -> NamedArrays:
        """Copies of the outer optimizer's momentum."""
        return {n: a.copy() for n, a in self._momentum.items()}

    @property
    def manifest(self) -> RunManifest:
        """The run's manifest, every attempt of every round, as stored (read from the
        store: the coordinator keeps only the current round's entries in memory)."""
        return RunManifest.load(self.store)

    @property
    def mode(self) -> RoundMode:
        """The kind of round this federation runs (plaintext or masked)."""
        return self._mode

    def next_attempt(self) -> int:
        """The attempt number the current round's next attempt will carry."""
        r = self._global.next_round
        return 1 + sum(1 for e in self._manifest.rounds if e.round == r)

    def round_open_for(self, peer: str) -> RoundOpen:
        """The plaintext RoundOpen the next attempt sends to ``peer``."""
        return self._round_open(self.next_attempt()).model_copy(
            update={"needs_commitment": not self.registry.is_bound(peer)}
        )

    def retry_allowed(self, outcome: RoundOutcome) -> bool:
        """Whether the error table and the attempt limit let ``outcome``'s round be retried."""
        return (
            outcome.error is not None
            and response_to(outcome.error) is Response.RETRY_ROUND
            and outcome.attempt < self.config.federation.max_round_attempts
        )

    # -- the blocking loop -------------------------------------------------------------
    def run(self, num_rounds: int) -> None:
        """Drive ``num_rounds`` rounds to CLOSED, retrying aborted rounds per the error table.

        Raises:
            ConfigError: under DP, the rounds up to ``target`` would take each
                participant past its budget (checked before any of them).
            LensembleError: the error of an attempt whose response is to stop the
                federation, or the last error once ``max_round_attempts`` is used up.
        """
        if num_rounds < 0:
            raise ValueError("num_rounds must be >= 0")
        target = self._global.round + num_rounds
        noise_multiplier_of(self.config, rounds=target)
        while self._global.round < target:
            outcome = self.run_attempt()
            if outcome.state is RoundState.CLOSED:
                continue
            assert outcome.error is not None
            if self.retry_allowed(outcome):
                log.info("round %d: retrying after %s", outcome.round, outcome.reason)
                self._wait_for_joins()
                continue
            log.error("round %d: federation stops: %s", outcome.round, outcome.reason)
            raise outcome.error

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
        check_adoptable(self._global.params, params)
        state = self._pin(self._global.round, params)  # a copy, hashed once
        adopted_hash = state.params_hash
        step = self._external_step
        if step is not None:
            if adopted_hash == step.adopted_hash:
                return step
            raise IllegalTransition(
                f"round {self._global.next_round} already trains from an adopted model "
                f"({step.adopted_hash[:12]}…); another would release the aggregate twice"
            )
        stepped_from = self._stepped_from
        attempt = self._attempt
        if attempt is not None and attempt.round == self._global.next_round:
            raise IllegalTransition(
                f"adopt: round {attempt.round} attempt {attempt.number} already started "
                "from the committed model"
            )
        if stepped_from is None or attempt is None:
            raise IllegalTransition(
                "adopt: this coordinator committed no round since it started; only the "
                "model a round just committed can be changed"
            )
        if adopted_hash == self._global.params_hash:
            return None
        momentum, step = take_external_step(
            self.store, self._global, stepped_from, state, self.config.outer
        )
        self._global, self._momentum, self._external_step = state, momentum, step
        log.info(
            "round %d trains from a model changed after the previous commit (change norm "
            "%.4g; recorded as its external step)",
            state.next_round,
            step.change_norm,
        )
        return step

    def grant_grace(self, seconds: float) -> None:
        """Extend the open and collect deadlines of the next attempt (only) by ``seconds``.

        For a cold start: the first messages of a run can wait on processes that are still
        starting (Ray actors, SuperNode ClientApp processes), which is not the
        participants' fault and should not abort the first round.
        """
        self._grace = max(0.0, float(seconds))

    def run_attempt(self) -> RoundOutcome:
        """Run one attempt of the current round over :attr:`transport`, without retrying.

        The phase loop: wait in OPEN, then in COLLECTING, each until :meth:`advance`
        leaves it or its deadline passes; then conclude the attempt.
        """
        transport = self._require_transport()
        fed = self.config.federation
        opened, self._opened = self._opened, None
        if isinstance(opened, RoundOutcome):
            return opened  # open_attempt's attempt ended as it was delivered
        if opened is None or opened is not self._attempt or opened.phase is not RoundState.OPEN:
            opened = self.begin_attempt()
            failed = self._deliver_invitations(opened)
            if failed is not None:
                return failed
        attempt = opened
        try:
            phases = ((fed.open_timeout, _DISCOVERY_INTERVAL), (fed.collect_timeout, None))
            for timeout, poll in phases:  # OPEN, then COLLECTING
                deadline = self._clock() + timeout + attempt.grace
                while True:
                    self._send_all(self.invite(transport.peers()))
                    remaining = deadline - self._clock()
                    # who is reachable once the invitations went out (delivering a
                    # RoundOpen can take a participant offline, or bring one back)
                    if self.advance(transport.peers(), deadline_passed=remaining <= 0):
                        break
                    wait = remaining if poll is None else min(remaining, poll)
                    self.receive(transport.recv(timeout_s=wait))
        except LensembleError as exc:
            return self.abort(exc)
        return self.conclude(exchange=self._exchange)

    def open_attempt(self) -> None:
        """Begin the next attempt and deliver its RoundOpens now, without waiting for a
        reply: the next :meth:`run_attempt` (or :meth:`run`) continues this attempt
        rather than beginning another. A caller with work of its own between rounds (the
        Flower strategy's metrics and log lines of the round just committed) does it while
        the participants train. The deadlines start when ``run_attempt`` starts waiting:
        time spent before that is not taken from the participants. Keep that time short
        over a transport whose messages expire (a Flower SuperLink drops an instruction,
        and its reply, once its TTL has passed).

        An error delivering the RoundOpens ends the attempt ABORTED, as in
        ``run_attempt``, which then returns that outcome (and ``run`` retries or stops
        per the error table); an error that is not a round's (a SuperLink out of reach)
        ends it ABORTED too, and is raised.

        Raises:
            IllegalTransition, LedgerError, ConfigError: as :meth:`begin_attempt` (nothing
                is started).
            ConfigError: under DP, the rounds up to this one would take a participant past
                its budget (as :meth:`run` checks; nothing is started).
        """
        self._require_transport()
        noise_multiplier_of(self.config, rounds=self._global.next_round)
        attempt = self.begin_attempt()
        failed = self._deliver_invitations(attempt)
        self._opened = failed if failed is not None else attempt

    def _deliver_invitations(self, attempt: Attempt) -> RoundOutcome | None:
        """Send the attempt's first RoundOpens and push them out; then make the files the
        round will write. The outcome if that ended the attempt (ABORTED), else None."""
        transport = self._require_transport()
        try:
            self._send_all(self.invite(transport.peers()))
            if isinstance(transport, BuffersSends):
                transport.deliver_queued()  # the instructions go out before anything else
            self._prepare_writes()
            if self.on_transition is not None:
                self.on_transition(attempt.machine)  # OPEN, its RoundOpens delivered
        except LensembleError as exc:
            return self.abort(exc)
        except Exception as exc:  # not a round's error (a SuperLink out of reach): the
            # attempt is over all the same, so that a later run begins the next one
            self.abort(
                FaultToleranceExceeded(
                    f"its RoundOpens could not be sent: {type(exc).__name__}: {exc}"
                )
            )
            raise
        return None

    def _prepare_writes(self) -> None:
        """Make now, while the round's instructions are out and its replies are awaited,
        the files the commit and the next attempt's marker will write, so that they are
        not made between this round's last reply and the next round's instructions
        (``Store.prepare_writes``). Only a saving: if it fails, the writes make their
        own files, and the failure is logged."""
        try:
            self.store.prepare_writes(WRITES_PREPARED)
        except StoreError as exc:
            log.warning("round writes not prepared ahead (they make their own files): %s", exc)

    # -- the steps every feeder drives -------------------------------------------------
    def _check_quorum_reachable(self) -> None:
        declared = (
            self.transport.declared_size()
            if isinstance(self.transport, DeclaresFederation)
            else None
        )
        fed = self.config.federation
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

    def begin_attempt(self) -> Attempt:
        """Start the next attempt of the current round (OPEN); nothing is sent yet.

        Raises:
            IllegalTransition: the previous attempt has not ended.
            LedgerError: the attempt was already started once (attempt numbers never
                repeat; a coordinator that died mid-attempt is resumed, not reused).
            ConfigError: the transport declares fewer participants than the quorum:
                no attempt could ever reach it (nothing is started).
        """
        if self._attempt is not None and self._attempt.phase not in TERMINAL_STATES:
            raise IllegalTransition(
                f"round {self._attempt.round} attempt {self._attempt.number} has not ended"
            )
        self._check_quorum_reachable()
        state, number = self._global, self.next_attempt()
        mark_started(self.store, state.next_round, number)
        fingerprint = None
        if self._gauge is not None and self.config.gauge.align:
            fingerprint = expected_fingerprint(self._gauge, self.config, state.sketch_seed)
        attempt = Attempt(
            machine=RoundMachine(state.next_round, number),
            state=state,
            external_step=self._external_step,
            round_open=self._round_open(number),
            started=self._clock(),
            grace=self._grace,
            transform=self._round_transform(state),
            sketch_fingerprint=fingerprint,
        )
        self._grace = 0.0
        self._reach.forget()  # its keys name the previous attempt, which can go now
        self._attempt = attempt
        self._stepped_from = None  # adopt() is refused from now on: θ_{t-1}, m_{t-1} can go
        self._mode.begin(attempt)
        return attempt

    def invite(self, reachable: Iterable[str]) -> list[tuple[str, RoundOpen]]:
        """The RoundOpens the current attempt owes ``reachable`` participants now (each
        one once; in a masked round, once more to members when the set is fixed). The
        caller delivers them (or already did, e.g. the shared folder's announcement)."""
        attempt = self._current()
        if attempt.phase not in (RoundState.OPEN, RoundState.COLLECTING):
            raise IllegalTransition(f"the round is {attempt.phase.value}: nobody to invite")
        peers = self._sampled(attempt, self._reach.peer_set(reachable))
        self._mode.settle(attempt, peers, final=False)
        # a plaintext call that invited nobody invites nobody again on the same inputs
        key = self._reach.invite_key(attempt, peers)
        plaintext = isinstance(self._mode, PlaintextMode)
        if plaintext and self._reach.invite_idle(key):
            return []
        invitations = []
        for peer in sorted(peers):
            message = self._mode.invitation(attempt, peer)
            if message is not None:
                invitations.append((peer, message))
        if plaintext and not invitations:
            self._reach.invited_nobody(key)
        return invitations

    def _sampled(self, attempt: Attempt, reachable: frozenset[str]) -> frozenset[str]:
        """The reachable participants the attempt may invite: all of them, or — when rounds
        are sampled — its sample. The sample is drawn once per attempt, when at least
        ``min-available`` participants are reachable (none are invited before), from a
        seed of the round and the attempt: each reachable participant is ranked by a
        SHA-256 of that seed and its id, and the first ``sample_size`` are invited."""
        fed = self.config.federation
        if not fed.sampled:
            return reachable
        if attempt.sample is None:
            if len(reachable) < max(fed.min_available, fed.quorum, 1):
                return frozenset()  # a sample below K could only abort: wait for more peers
            seed = derive_seed(fed.root_seed, "sample", attempt.round, attempt.number)
            if fed.sample_mode == "poisson":
                drawn = poisson_draw(reachable, fed.sample_fraction, seed, fed.quorum)
            else:
                drawn = seeded_sample(reachable, fed.sample_size(len(reachable)), seed, "sample")
            attempt.sample = frozenset(drawn)
            self._warn_if_oversampled(len(attempt.sample), len(reachable))
            if len(attempt.sample) < fed.quorum:
                return frozenset()  # nobody trains for an attempt that can only abort
            log.info(
                "round %d attempt %d: sampled %d of %d reachable participants",
                attempt.round,
                attempt.number,
                len(attempt.sample),
                len(reachable),
            )
        return self._reach.sampled(reachable, attempt.sample)

    def _warn_if_oversampled(self, drawn: int, reachable: int) -> None:
        """Warn (once) when a fixed sample asks more participants than ``sample-fraction``
        of them (raised to ``sample-min`` or the quorum) while the privacy plan counts on
        that fraction (``privacy.calibration.releases_of``): participants then spend their
        budgets faster than planned, and more of them refuse before the last round."""
        fed = self.config.federation
        if self._oversampling_warned or not self.config.privacy.noised:
            return
        if fed.sample_mode != "fixed" or drawn <= fed.sample_fraction * reachable + 1:
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
            self.config.privacy.dp_overrun,
        )

    def rename(self, address: str, participant: str) -> bool:
        """The transport learnt that the peer it addressed as ``address`` (a Flower node
        it had not heard from) is participant ``participant``: the current attempt's
        invitation and sample follow the participant's own name. False (nothing
        changes) when ``address`` already answered this attempt under that name: one
        peer may not contribute under two names."""
        attempt = self._attempt
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
        if address in attempt.invited:  # a new set: what was derived from the old one is stale
            attempt.invited = (attempt.invited - {address}) | {participant}
        if attempt.sample is not None and address in attempt.sample:
            attempt.sample = (attempt.sample - {address}) | {participant}
        log.info("round %d: %s is participant %s", attempt.round, address, participant)
        return True

    def receive(
        self, payload: WirePayload | None, *, prepared: Prepared | None = None
    ) -> Verdict | None:
        """Validate one payload and hand it to the admission table.

        Errors whose response is to reject the message are logged and counted (None is
        returned), and so is any untyped error a malformed message could still raise
        (logged with its traceback); every other typed error propagates, and the caller
        aborts the attempt or stops. ``prepared``: the payload already validated and its
        arrays hashed (or the error that raised), as :meth:`conclude_collected` does for a
        batch on threads.
        """
        if payload is None:
            return None
        attempt = self._current()
        try:
            if prepared is None:
                message, fields = from_wire(payload), None
            else:
                message, fields = prepared.result()
            filed = isinstance(payload, FiledByTransport)
            verdict = admit(
                attempt,
                message,
                self._ingress,
                self._mode.admission,
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
            attempt.rejected += 1
            log.warning(
                "round %d: message rejected (%s): %s", attempt.round, type(exc).__name__, exc
            )
            keyless = not self.registry.has_key(str(payload.get("participant_id")))
            _answered_all_the_same(attempt, payload, exc, keyless=keyless)
            return None
        except _UNTYPED_INPUT_ERRORS as exc:
            # A message that passed validation and still tripped something below: it is
            # rejected like any bad message (and logged with its traceback, as a bug),
            # never a crash of the coordinator. I/O errors are not the message's: they
            # propagate.
            attempt.rejected += 1
            log.exception("round %d: message rejected (untyped error)", attempt.round)
            _answered_all_the_same(attempt, payload, exc)
            return None

    def advance(self, reachable: Iterable[str], *, deadline_passed: bool) -> bool:
        """Leave OPEN or COLLECTING if the phase's exit condition holds; True if it did.

        OPEN is left once K participants are ready; COLLECTING once no eligible,
        reachable participant is still to deliver, or at the deadline with a quorum.

        Raises:
            FaultToleranceExceeded: the phase's deadline passed (or the quorum can no
                longer be met) short of K.
            IllegalTransition: the attempt is in neither phase.
        """
        attempt, quorum = self._current(), self.config.federation.quorum
        peers: set[str] | frozenset[str] = self._reach.peer_set(reachable)
        available, wanted = len(peers), self.config.federation.min_available
        if self.config.federation.sampled:  # only the sample counts (none before it is drawn)
            peers = set() if attempt.sample is None else self._reach.sampled(peers, attempt.sample)
        if attempt.sample is not None and len(attempt.sample) < quorum:
            raise FaultToleranceExceeded(  # every Poisson draw was below K: none was invited
                f"the attempt's sample has {len(attempt.sample)} participants, quorum {quorum}"
            )
        if attempt.phase is RoundState.OPEN:
            self._mode.settle(attempt, peers, final=deadline_passed)
            ready = self._mode.ready(attempt, peers)
            if len(ready) >= quorum:
                self._fire(attempt, RoundEvent.QUORUM_REACHED)
                return True
            sampled = self.config.federation.sampled
            if deadline_passed and sampled and attempt.sample is None and available < wanted:
                raise FaultToleranceExceeded(
                    f"{available} participants reachable by the open timeout, and a sampled "
                    f"attempt draws none before min-available = {wanted} are (FedAvg's "
                    "min_available_nodes)"
                )
            if deadline_passed:
                raise FaultToleranceExceeded(
                    f"{len(ready)} of quorum {quorum} participants ready by the open timeout "
                    f"({self._mode.readiness}), of {available} reachable"
                )
            return False
        if attempt.phase is RoundState.COLLECTING:
            eligible = self._mode.eligible(attempt)
            outstanding = self._reach.outstanding(attempt, eligible, peers)
            if outstanding and len(attempt.admitted) + len(outstanding) < quorum:
                raise FaultToleranceExceeded(
                    f"{len(attempt.admitted)} updates and {len(outstanding)} reachable "
                    f"participants left; quorum {quorum} cannot be met{_shortfall(attempt)}"
                )
            if outstanding and not deadline_passed:
                return False
            if len(attempt.admitted) < quorum:
                when = "and nobody left to answer"
                if outstanding:  # name who kept the round waiting
                    silent = sorted(outstanding)
                    more = f" and {len(silent) - 3} more" if len(silent) > 3 else ""
                    when = (
                        f"by the collect deadline (no answer from {', '.join(silent[:3])}{more})"
                    )
                raise FaultToleranceExceeded(
                    f"{len(attempt.admitted)} updates {when}, quorum {quorum}{_shortfall(attempt)}"
                )
            self.registry.persist()  # the bindings this round's sum rests on
            self._fire(attempt, RoundEvent.COLLECTION_CLOSED)
            return True
        raise IllegalTransition(f"the round is {attempt.phase.value}: nothing to advance")

    def conclude(self, exchange: Exchange | None = None) -> RoundOutcome:
        """AGGREGATING → ALIGNING → COMMITTING → CLOSED, or ABORTED; then announce.

        ``exchange`` carries a masked round's unmask exchange (see :mod:`.modes`).

        Raises:
            IllegalTransition: the attempt is not AGGREGATING (nothing changes).
            Exception: a failure to write the manifest entry after the commit point, once
                the CLOSED outcome is recorded and the round announced (the run's store
                is failing: stop; resume completes the entry from the kept closing one).
        """
        attempt = self._current()
        if attempt.phase is not RoundState.AGGREGATING:
            raise IllegalTransition(f"cannot conclude a round that is {attempt.phase.value}")
        try:
            result = self._mode.reveal(attempt, exchange)
            self._fire(attempt, RoundEvent.SUM_REPRODUCED)
            mean = result.mean()
            diagnostics = self._diagnose(attempt.state, mean)
            self._fire(attempt, RoundEvent.DIAGNOSED)
            groups = self.config.groups
            averaged = frozenset(n for n in attempt.state.params if groups.is_averaged(n))
            params, momentum = outer_step(  # m' is written over the mean (not used again)
                attempt.state.params, self._momentum, mean, self.config.outer, averaged,
                consume_mean=True,
            )  # fmt: skip
            committed = write_commit(
                self.store,
                self._ledger,
                attempt,
                result,
                diagnostics,
                lambda: self._pin(attempt.round, params, copy=False),  # θ_r: fresh arrays
                momentum,
                head_hash=self._head_hash,
                secure_sum=self._mode.secure_sum,
                manifest=self._manifest,
                privacy=self._privacy,
            )
        except LensembleError as exc:
            return self.abort(exc)
        # -- the commit point: the ledger holds the round; nothing below may abort it ----
        prior = attempt.state
        self._stepped_from = SteppedFrom(prior.params, self._momentum, averaged)
        self._external_step = None
        self._global, self._momentum = committed.state, committed.momentum
        self._head_hash = committed.record.record_hash
        self._fire(attempt, RoundEvent.COMMITTED)
        if unbound := committed.record.unbound:
            more = f" and {len(unbound) - 5} more (lensemble-flwr show lists them)"
            log.warning(
                "round %d closed with UNBOUND contributions (no dataset commitment) from %s%s",
                attempt.round,
                ", ".join(unbound[:5]),
                more if len(unbound) > 5 else "",
            )
        stored_error: BaseException | None = None
        try:
            # the closed round's entries stay in the store only: memory does not grow
            self._manifest = self._manifest.with_round(self.store, committed.entry).since(
                self._global.next_round
            )
        except Exception as exc:  # resume completes the entry from the kept closing one
            log.error("round %d committed; its manifest entry failed: %r", attempt.round, exc)
            stored_error = exc
        else:  # the round's evidence is complete: prune what the policy keeps no more
            self._prune_from = retain(
                self.store, self.config.retention, committed.record, self._prune_from
            )
        outcome = self._outcome(attempt, result, diagnostics, None)
        self.last_close = RoundClose(
            run_id=self.run_id,
            round=attempt.round,
            sender=COORDINATOR,
            previous_hash=prior.params_hash,
            global_hash=committed.state.params_hash,
            count=len(result.contributors),
            record_hash=committed.record.record_hash,
        )
        self._announce(self.last_close)
        self._report(outcome)
        if stored_error is not None:
            raise stored_error  # the store is failing: stop; the round stays committed
        return outcome

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
        if self._mode.secure_sum:
            raise ConfigError(
                "secagg-threshold",
                "a masked round needs an unmask exchange within the attempt, which a batch "
                "of collected messages does not carry; run it with Coordinator.run",
            )
        peers = sorted(set(reachable))
        attempt = self._current()
        batch = list(payloads)
        try:
            for payload, prepared in zip(batch, prepare_batch(batch), strict=True):
                self.receive(payload, prepared=prepared)
            while attempt.phase in (RoundState.OPEN, RoundState.COLLECTING):
                self.advance(peers, deadline_passed=True)
        except LensembleError as exc:
            return self.abort(exc)
        return self.conclude(exchange=None)

    def abort(self, error: LensembleError) -> RoundOutcome:
        """End the current attempt ABORTED with ``error``; the global state is untouched."""
        attempt = self._current()
        reason = f"{type(error).__name__}: {error}"
        self._fire(attempt, RoundEvent.ABORT, reason=reason)
        log.warning("round %d attempt %d ABORTED: %s", attempt.round, attempt.number, reason)
        # kept in the outcome without its traceback: its frames hold the attempt, the sum
        # and the model (kept outcomes would pin them, and the sum's buffers, for good)
        outcome = self._outcome(attempt, None, {}, error.with_traceback(None))
        entry = entry_of(attempt, None, {}, reason, secure_sum=self._mode.secure_sum)
        self._manifest = self._manifest.with_round(self.store, entry)
        self._report(outcome)
        return outcome

    # -- helpers -----------------------------------------------------------------------
    def _current(self) -> Attempt:
        if self._attempt is None:
            raise IllegalTransition("no round attempt has begun")
        return self._attempt

    def _require_transport(self) -> Transport:
        if self.transport is None:
            raise ConfigError("transport", "the blocking round loop needs a transport")
        return self.transport

    def _fire(self, attempt: Attempt, event: RoundEvent, *, reason: str | None = None) -> None:
        attempt.machine.fire(event, reason=reason)
        if self.on_transition is not None:
            self.on_transition(attempt.machine)

    def _send_all(self, messages: Iterable[tuple[str, ControlMessage]]) -> None:
        transport = self._require_transport()
        for peer, message in messages:
            transport.send(peer, message)

    def _exchange(self, requests: Mapping[str, UnmaskRequest], done: Callable[[], bool]) -> None:
        """A second exchange within the attempt (a masked round's unmask requests), over
        the transport, until ``done()`` or the collect timeout passed."""
        transport = self._require_transport()
        self._send_all(requests.items())
        deadline = self._clock() + self.config.federation.collect_timeout
        while not done() and (remaining := deadline - self._clock()) > 0:
            self.receive(transport.recv(timeout_s=remaining))

    def _announce(self, close: RoundClose) -> None:
        """Tell every participant the round closed. It is committed already: a failure
        here is logged, and participants learn the new state from the next RoundOpen."""
        if self.transport is None:
            return  # a batch feeder sends the close with its next instructions
        try:
            self.transport.broadcast(close)
        except Exception as exc:
            log.error("round %d is committed, but RoundClose was not sent: %r", close.round, exc)

    def _outcome(
        self,
        attempt: Attempt,
        result: AggregateSum | None,
        diagnostics: Mapping[str, float],
        error: LensembleError | None,
    ) -> RoundOutcome:
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
            global_hash=self._global.params_hash,
            diagnostics=dict(diagnostics),
            elapsed=self._clock() - attempt.started,
            path=attempt.path(),
            refused=tuple(sorted(set(attempt.refused) & attempt.invited - attempt.admitted)),
        )

    def _report(self, outcome: RoundOutcome) -> None:
        self.outcomes.append(outcome)
        if self._on_round is not None:
            self._on_round(outcome)

    def _admitted_digests(self, round: int, attempt: int) -> Mapping[str, str] | None:
        for entry in self._manifest.rounds:  # the current round's entries
            if (entry.round, entry.attempt) == (round, attempt):
                return entry.update_digests
        if round >= self._global.next_round:
            return None  # not recorded yet, so not in the store either
        key = (round, attempt)
        if key not in self._older_digests:  # read once; the last few are kept
            if len(self._older_digests) >= _OLDER_ENTRIES_KEPT:
                del self._older_digests[next(iter(self._older_digests))]
            entry = RunManifest.entry(self.store, round, attempt)
            self._older_digests[key] = entry.update_digests if entry is not None else None
        return self._older_digests[key]

    def _round_open(self, attempt: int) -> RoundOpen:
        state = self._global
        return RoundOpen(
            run_id=self.run_id,
            round=state.next_round,
            sender=COORDINATOR,
            attempt=attempt,
            global_hash=state.params_hash,
            params=state.params,
            sketch_seed=state.sketch_seed,
            h_steps=state.h_steps,
            probe_hash=state.probe_hash,
            landmark_hashes=state.landmark_hashes,
        )

    def _pin(
        self, round: int, params: Mapping[str, np.ndarray], *, copy: bool = True
    ) -> GlobalState:
        """θ_``round``, carrying the seed of the round that starts from it (round + 1)."""
        fed = self.config.federation
        pinned = self._gauge is not None and self.config.gauge.align
        probe = self._gauge.probe if pinned else None  # type: ignore[union-attr]
        return GlobalState.create(
            round,
            params,
            sketch_seed=derive_seed(fed.root_seed, "round", round + 1),
            h_steps=self.config.inner.steps,
            probe_hash=probe.probe_hash if probe is not None else "",
            landmark_hashes=probe.landmark_hashes if probe is not None else (),
            copy=copy,
        )

    def _round_transform(self, state: GlobalState) -> Callable[[Update], Update] | None:
        """What transforms each plaintext update before it is summed (research only)."""
        if self.config.gauge.coordinator_harness:
            assert self._gauge is not None  # require_setup
            return harness_transform(self._gauge, self.config, state.params, state.sketch_seed)
        return self._update_transform

    def _diagnose(self, state: GlobalState, mean: NamedArrays) -> dict[str, float]:
        """ALIGNING: diagnostics of the averaged model only (public probe, no individual
        update: a masked round has none to look at)."""
        diagnostics = {"mean_delta_l2": l2_norm(mean)}
        if self._gauge is not None:
            diagnostics |= drift_diagnostics(
                self._gauge, self.config, state.params, mean, round=state.next_round
            )
        return diagnostics

    def _wait_for_joins(self) -> None:
        """Give (re)joining participants ``retry_wait`` seconds; drop what arrives."""
        transport = self._require_transport()
        deadline = self._clock() + self.config.federation.retry_wait
        while (remaining := deadline - self._clock()) > 0:
            payload = transport.recv(timeout_s=remaining)
            if payload is not None:
                log.info("between attempts: dropped a %s", kind_of(payload) or "message")
