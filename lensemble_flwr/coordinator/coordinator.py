"""The coordinator: one round loop driving the RoundState machine over any Transport.

A round attempt, in order::

    OPEN         send RoundOpen to every reachable participant (and to any that appears
                 while the round is open); leave once K = max(min_participants,
                 secagg_threshold) are ready — bound to a dataset commitment, or merely
                 reachable when binding is not required — or abort at the open timeout
    COLLECTING   admit updates until every invited participant delivered (or became
                 unreachable), or the collect deadline; the contributing set freezes here
    AGGREGATING  reveal the exact sum; self-check, one re-sum on a mismatch
    ALIGNING     aggregate-level diagnostics only
    COMMITTING   outer step, checkpoint, ledger record — then, and only then, the new
                 global state replaces the old one in memory (the single state change)
    CLOSED       RoundClose broadcast

Any typed error on the way aborts the attempt with the global state untouched; what
happens next (retry the round, stop the federation, or just drop the message) is looked
up in :data:`lensemble_flwr.errors.RESPONSES`.

A participant binds its dataset commitment once and stays bound: later RoundOpens tell
it not to resend it, so a steady-state round is one exchange (RoundOpen → Update).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np

from lensemble_flwr.aggregation.fixed_point import AggregateSum, Aggregator, FixedPointAggregator
from lensemble_flwr.artifacts.checkpoint import decode_checkpoint, encode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.coordinator.durable import (
    load_closing,
    mark_started,
    save_closing,
    started_attempts,
)
from lensemble_flwr.coordinator.outer_optimizer import outer_step, zero_momentum
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    ConfigError,
    DuplicateMessage,
    FaultToleranceExceeded,
    LedgerError,
    LensembleError,
    NonDeterministicAggregation,
    ParameterMismatch,
    ReplayedMessage,
    ResidencyViolation,
    Response,
    RoundError,
    StoreError,
    UnprivatizedContribution,
    reported,
    response_to,
)
from lensemble_flwr.gauge.runtime import (
    GaugeSetup,
    check_sketch,
    check_warm_start_of,
    drift_diagnostics,
    expected_fingerprint,
    harness_transform,
    require_setup,
)
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.params import NamedArrays, is_shared
from lensemble_flwr.protocol.messages import (
    Commitment,
    ControlMessage,
    Refusal,
    RoundClose,
    RoundOpen,
    UnmaskRequest,
    UnmaskResponse,
    Update,
    WirePayload,
    canonical_fields,
    from_wire,
    message_digest,
)
from lensemble_flwr.protocol.round import RoundEvent, RoundMachine, RoundState
from lensemble_flwr.protocol.state import GlobalState, l2_norm
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    ContributionRecord,
    Ledger,
    RoundEntry,
    RunManifest,
    verify,
    verify_chain,
)
from lensemble_flwr.secagg.aggregator import SecureAggregator
from lensemble_flwr.secagg.participant_role import encode_member
from lensemble_flwr.secagg.protocol import Member, context_of
from lensemble_flwr.transports.base import COORDINATOR, Transport

log = logging.getLogger(__name__)


def _parse_shares(response: UnmaskResponse) -> dict[str, dict[str, tuple[int, int]]]:
    """An UnmaskResponse's 'x:y_hex' shares as (x, y) pairs."""
    try:
        return {
            which: {s: (int(v.split(":")[0]), int(v.split(":")[1], 16)) for s, v in shares.items()}
            for which, shares in (("b", response.b_shares), ("m", response.m_shares))
        }
    except (ValueError, IndexError):
        raise RoundError(f"{response.participant_id}: malformed shares") from None


_DISCOVERY_INTERVAL = 1.0
"""Seconds between looks for newly reachable participants while a round is OPEN."""

INTERRUPTED = "CoordinatorRestart: the attempt was cut short by a coordinator restart"
"""The reason recorded for an attempt a crash interrupted."""

_RECORDED_FROM_ENTRY = {
    "round",
    "attempt",
    "contributors",
    "count",
    "total_weight",
    "update_digests",
    "aggregate_digest",
    "new_global_hash",
    "round_seed",
}
"""The ledger record's fields that are the closing manifest entry's, under the same name."""

AggregatorFactory = Callable[[Mapping[str, np.ndarray], AggregationConfig, int], Aggregator]


def fixed_point_aggregator(
    template: Mapping[str, np.ndarray], config: AggregationConfig, check_seed: int
) -> Aggregator:
    """The default aggregator: the exact plaintext fixed-point sum."""
    return FixedPointAggregator(template, config, check_seed=check_seed)


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """How one round attempt ended (also recorded in the run manifest)."""

    round: int
    attempt: int
    state: RoundState
    error: LensembleError | None
    count: int
    contributors: tuple[str, ...]
    late: tuple[str, ...]
    rejected: int
    global_hash: str
    diagnostics: Mapping[str, float]
    elapsed: float
    path: tuple[RoundState, ...] = ()

    @property
    def reason(self) -> str | None:
        return None if self.error is None else f"{type(self.error).__name__}: {self.error}"


@dataclasses.dataclass
class _Attempt:
    """Everything one round attempt accumulates; discarded when it ends."""

    machine: RoundMachine
    state: GlobalState
    aggregator: Aggregator | None
    round_open: RoundOpen
    grace: float = 0.0
    transform: Callable[[Update], Update] | None = None  # the research harness, if any
    sketch_fingerprint: str | None = None  # gauge alignment: the round's sketch
    closing: RoundEntry | None = None  # the manifest entry, once the commit is prepared
    members: list[Member] | None = None  # a masked round's member set, once fixed
    members_sent: set[str] = dataclasses.field(default_factory=set)
    key_shares: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)
    invited: set[str] = dataclasses.field(default_factory=set)
    admitted: set[str] = dataclasses.field(default_factory=set)
    roots: dict[str, str | None] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    epsilon: dict[str, float | None] = dataclasses.field(default_factory=dict)
    update_digests: dict[str, str] = dataclasses.field(default_factory=dict)
    late: set[str] = dataclasses.field(default_factory=set)
    rejected: int = 0


class Coordinator:
    """Drives rounds, holds the canonical global state, runs the outer optimizer.

    Who takes part — bindings, identity keys, masked-round membership — is in
    :attr:`registry` (:class:`~lensemble_flwr.identity.registry.ParticipantRegistry`).

    Args:
        config: the federation's config.
        transport: the coordinator's end of any :class:`Transport`.
        initial_params: θ_0, the shared groups' initial arrays (float).
        store: the run directory's artifact store (checkpoints, ledger, manifest).
        run_id: names the run in every message; messages of other runs are rejected.
        aggregator_factory: builds the round's :class:`Aggregator` from the global params,
            the aggregation config and the self-check seed.
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
    """

    def __init__(
        self,
        config: LensembleConfig,
        *,
        transport: Transport,
        initial_params: Mapping[str, np.ndarray],
        store: Store,
        run_id: str = "lensemble-run",
        aggregator_factory: AggregatorFactory = fixed_point_aggregator,
        on_round: Callable[[RoundOutcome], None] | None = None,
        update_transform: Callable[[Update], Update] | None = None,
        gauge: GaugeSetup | None = None,
        identities: Mapping[str, str] | None = None,
    ) -> None:
        for name, array in initial_params.items():
            if not np.issubdtype(np.asarray(array).dtype, np.floating):
                raise ParameterMismatch(f"{name}: initial params must be floating-point")
        local = sorted(n for n in initial_params if not is_shared(n, config.groups))
        if local:
            raise ResidencyViolation(f"local parameters may never be broadcast: {local}")
        check_warm_start_of(gauge, config, initial_params)
        if store.bound("ledger/") or store.bound("manifest"):
            raise StoreError(
                f"{store.root} already holds a run; use a fresh run directory, or "
                "Coordinator.resume to continue it"
            )
        self._setup(
            config,
            transport,
            store,
            run_id,
            aggregator_factory,
            on_round,
            update_transform,
            gauge,
            identities,
        )
        self._global = self._pin(0, {n: np.asarray(a) for n, a in initial_params.items()})
        self._momentum: NamedArrays = zero_momentum(self._global.params)
        initial = store.put(encode_checkpoint(0, self._global.params, self._momentum))
        self._manifest = RunManifest(
            run_id=run_id,
            config=config.to_run_config(),
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
        transport: Transport,
        store: Store,
        aggregator_factory: AggregatorFactory = fixed_point_aggregator,
        on_round: Callable[[RoundOutcome], None] | None = None,
        update_transform: Callable[[Update], Update] | None = None,
        gauge: GaugeSetup | None = None,
        identities: Mapping[str, str] | None = None,
        check: Literal["full", "chain"] = "full",
    ) -> Coordinator:
        """Continue the run held in ``store`` after the coordinator stopped (or crashed).

        The resumed coordinator starts from the last CLOSED round: the newest ledger
        record's checkpoint (params and momentum), the ledger head, the participant
        registry and the attempt counter all come from the store. A commit the crash cut
        short between the ledger record and the manifest entry is completed from the
        record; an attempt that started but never finished is recorded as aborted. The
        round that was in flight is then retried under a new attempt number.

        ``check="full"`` verifies the whole run first (every record and every checkpoint,
        as :func:`~lensemble_flwr.provenance.ledger.verify`); ``check="chain"`` verifies
        the records' hash chain and only the checkpoint it resumes from — for a caller
        that resumes every round (the shared-folder runner), where a full check would make
        a run cost quadratic time.

        Raises:
            StoreError: ``store`` holds no run.
            ConfigError: ``config`` is not the configuration the run was started with.
            LedgerError: the stored ledger, manifest or registry is inconsistent (the
                run is not resumed: ``lensemble-flwr verify`` names the broken link).
        """
        manifest = RunManifest.load(store)
        config.check_recorded(manifest.config)
        self = cls.__new__(cls)
        self._setup(
            config,
            transport,
            store,
            manifest.run_id,
            aggregator_factory,
            on_round,
            update_transform,
            gauge,
            identities,
        )
        self._manifest = manifest
        self._recover(check)
        return self

    def _setup(
        self,
        config: LensembleConfig,
        transport: Transport,
        store: Store,
        run_id: str,
        aggregator_factory: AggregatorFactory,
        on_round: Callable[[RoundOutcome], None] | None,
        update_transform: Callable[[Update], Update] | None,
        gauge: GaugeSetup | None,
        identities: Mapping[str, str] | None,
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
        self.transport = transport
        self.store = store
        self.run_id = run_id
        self._aggregator_factory = aggregator_factory
        self._update_transform = update_transform
        self._gauge = gauge
        self.registry = ParticipantRegistry(config, store, identities)
        self._on_round = on_round
        self._ledger = Ledger(store)
        self._head_hash = GENESIS
        self._machine: RoundMachine | None = None
        self.last_close: RoundClose | None = None
        self._grace = 0.0
        self.outcomes: list[RoundOutcome] = []

    def _recover(self, check: Literal["full", "chain"]) -> None:
        """Rebuild the committed state from the store (see :meth:`resume`)."""
        records = self._ledger.records()
        closed = {e.round for e in self._manifest.rounds if e.state == "closed"}
        if records and records[-1].round not in closed:
            rec = records[-1]  # committed, but the crash came before its manifest entry
            log.warning("round %d: completing the manifest after a crash", rec.round)
            kept = load_closing(self.store)
            if kept is None or (kept.round, kept.attempt, kept.new_global_hash) != (
                rec.round,
                rec.attempt,
                rec.new_global_hash,
            ):
                raise LedgerError(
                    f"round {rec.round} is in the ledger but not in the manifest, and the "
                    "manifest entry kept before its commit is missing or is another round's"
                )
            entry = kept
            self._manifest = self._manifest.with_round(self.store, entry)
        if check == "full":
            verify(self.store)
        else:
            verify_chain(records, self._manifest)
        head = records[-1] if records else None
        ckpt = decode_checkpoint(
            self.store.get(head.checkpoint if head else self._manifest.initial_checkpoint)
        )
        expected = head.new_global_hash if head else self._manifest.initial_params_hash
        if ckpt.params_hash != expected:
            raise LedgerError("the checkpoint to resume from does not hold the recorded state")
        self._global = self._pin(ckpt.round, ckpt.params, copy=False)
        self._momentum = ckpt.momentum
        self._head_hash = head.record_hash if head else GENESIS
        self.registry.restore()
        t = self._global.round
        finished = {e.attempt for e in self._manifest.rounds if e.round == t}
        for attempt in started_attempts(self.store, t):
            if attempt in finished:
                continue
            log.warning("round %d attempt %d was interrupted by a restart", t, attempt)
            self._manifest = self._manifest.with_round(
                self.store,
                RoundEntry(
                    round=t,
                    attempt=attempt,
                    state="aborted",
                    reason=INTERRUPTED,
                    round_seed=self._global.sketch_seed,
                    prior_global_hash=self._global.params_hash,
                ),
            )
        log.info(
            "resumed run %s at round %d (%d participants registered)",
            self.run_id,
            t,
            len(self.registry.commitments),
        )

    # -- observability -----------------------------------------------------------------
    def round_state(self) -> RoundState:
        """State of the current (or last) round attempt; CLOSED before the first round."""
        return self._machine.state if self._machine else RoundState.CLOSED

    def global_state(self) -> GlobalState:
        """The canonical committed global state (the state the next round starts from)."""
        return self._global

    def momentum(self) -> NamedArrays:
        """Copies of the outer optimizer's momentum."""
        return {n: a.copy() for n, a in self._momentum.items()}

    @property
    def manifest(self) -> RunManifest:
        return self._manifest

    # -- the round loop ----------------------------------------------------------------
    def run(self, num_rounds: int) -> None:
        """Drive ``num_rounds`` rounds to CLOSED, retrying aborted rounds per the error table.

        Raises:
            LensembleError: the error of an attempt whose response is to stop the
                federation, or the last error once ``max_round_attempts`` is used up.
        """
        if num_rounds < 0:
            raise ValueError("num_rounds must be >= 0")
        target = self._global.round + num_rounds
        while self._global.round < target:
            outcome = self.run_attempt()
            if outcome.state is RoundState.CLOSED:
                continue
            assert outcome.error is not None
            response = response_to(outcome.error)
            retries_left = outcome.attempt < self.config.federation.max_round_attempts
            if response is Response.RETRY_ROUND and retries_left:
                log.info("round %d: retrying after %s", outcome.round, outcome.reason)
                self._wait_for_joins()
                continue
            log.error("round %d: federation stops: %s", outcome.round, outcome.reason)
            raise outcome.error

    def grant_grace(self, seconds: float) -> None:
        """Extend the open and collect deadlines of the next attempt (only) by ``seconds``.

        For a cold start: the first messages of a run can wait on processes that are still
        starting (Ray actors, SuperNode ClientApp processes), which is not the
        participants' fault and should not abort the first round.
        """
        self._grace = max(0.0, float(seconds))

    def next_attempt(self) -> int:
        """The attempt number the current round's next attempt will carry."""
        t = self._global.round
        return 1 + sum(1 for e in self._manifest.rounds if e.round == t)

    def round_open_for(self, peer: str) -> RoundOpen:
        """The RoundOpen the next attempt sends to ``peer``."""
        state = self._global
        return RoundOpen(
            run_id=self.run_id,
            round=state.round,
            sender=COORDINATOR,
            attempt=self.next_attempt(),
            global_hash=state.params_hash,
            params=state.params,
            sketch_seed=state.sketch_seed,
            h_steps=state.h_steps,
            probe_hash=state.probe_hash,
            landmark_hashes=state.landmark_hashes,
            needs_commitment=not self.registry.is_bound(peer),
        )

    def run_attempt(self, *, transport: Transport | None = None) -> RoundOutcome:
        """Run one attempt of the current round, without retrying; optionally over another
        transport (e.g. replies that were already collected)."""
        if transport is None:
            return self._run_attempt(self._global.round, self.next_attempt())
        own, self.transport = self.transport, transport
        try:
            return self._run_attempt(self._global.round, self.next_attempt())
        finally:
            self.transport = own

    def _pin(
        self, round: int, params: Mapping[str, np.ndarray], *, copy: bool = True
    ) -> GlobalState:
        fed = self.config.federation
        pinned = self._gauge is not None and self.config.gauge.align
        probe = self._gauge.probe if pinned else None  # type: ignore[union-attr]
        return GlobalState.create(
            round,
            params,
            sketch_seed=derive_seed(fed.root_seed, "round", round),
            h_steps=self.config.inner.steps,
            probe_hash=probe.probe_hash if probe is not None else "",
            landmark_hashes=probe.landmark_hashes if probe is not None else (),
            copy=copy,
        )

    def _run_attempt(self, t: int, attempt: int) -> RoundOutcome:
        started = self.transport.now()
        state = self._global
        mark_started(self.store, t, attempt)
        machine = RoundMachine(t, attempt)
        self._machine = machine
        ctx = _Attempt(
            machine=machine,
            state=state,
            aggregator=None
            if self._masked
            else self._aggregator_factory(
                state.params,
                self.config.aggregation,
                derive_seed(self.config.federation.root_seed, "self-check", t, attempt),
            ),
            round_open=self.round_open_for(COORDINATOR),
            grace=self._grace,
            transform=self._round_transform(state),
            sketch_fingerprint=expected_fingerprint(self._gauge, self.config, state.sketch_seed)
            if self._gauge is not None and self.config.gauge.align
            else None,
        )
        self._grace = 0.0
        self._fix_members(ctx)
        self._invite(ctx)
        result: AggregateSum | None = None
        diagnostics: dict[str, float] = {}
        error: LensembleError | None = None
        try:
            self._open(ctx)
            machine.fire(RoundEvent.QUORUM_REACHED)
            self._collect(ctx)
            machine.fire(RoundEvent.COLLECTION_CLOSED)
            result = self._aggregate(ctx)
            machine.fire(RoundEvent.SUM_REPRODUCED)
            mean = result.mean()
            diagnostics = self._diagnose(state, mean)
            machine.fire(RoundEvent.DIAGNOSED)
            self._commit(ctx, result, mean, diagnostics)
            machine.fire(RoundEvent.COMMITTED)
        except LensembleError as exc:
            error = exc
            machine.fire(RoundEvent.ABORT, reason=f"{type(exc).__name__}: {exc}")
            log.warning("round %d attempt %d ABORTED: %s", t, attempt, machine.abort_reason)
        return self._record(ctx, result, diagnostics, error, started)

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
                self._gauge, self.config, state.params, mean, round=state.round
            )
        return diagnostics

    @property
    def _masked(self) -> bool:
        return self.config.federation.secagg_threshold > 0

    def _fix_members(self, ctx: _Attempt, *, final: bool = False) -> None:
        """Masked rounds: fix the round's members — every reachable participant once all
        of them are keyed (or, when the open timeout is up, the keyed ones if they are at
        least K) — and build the secure aggregator for exactly them."""
        if not self._masked or ctx.members is not None:
            return
        reachable = set(self.transport.peers())
        keyed = sorted(p for p in reachable if self.registry.keyed(p))
        if len(keyed) < self.config.federation.quorum:
            return
        if not final and set(keyed) != reachable:
            return  # somebody is still committing its keys
        members = self.registry.members(keyed)
        ctx.key_shares.update(self.registry.membership.shares_for(members))
        ctx.members = members
        ctx.aggregator = SecureAggregator(
            ctx.state.params,
            self.config.aggregation,
            members=members,
            threshold=self.config.federation.secagg_threshold,
            context=context_of(self.run_id, ctx.machine.round, ctx.machine.attempt),
            mask_key_shares=ctx.key_shares,
            degree=self.config.federation.secagg_neighbours,
        )

    def _invite(self, ctx: _Attempt) -> None:
        """Send this attempt's RoundOpen to every reachable participant not yet invited (and,
        in a masked round, once more to members who were invited before the set was fixed)."""
        member_ids = {m.pid for m in ctx.members or []}
        encoded = tuple(encode_member(m) for m in ctx.members or [])
        for peer in self.transport.peers():
            resend = peer in member_ids and peer not in ctx.members_sent
            if peer in ctx.invited and not resend:
                continue
            ctx.invited.add(peer)
            changes: dict[str, object] = {"needs_commitment": not self.registry.is_bound(peer)}
            if self._masked:
                changes.update(
                    needs_commitment=not self.registry.keyed(peer),
                    rekey=peer in self.registry.membership.compromised,
                    secagg_threshold=self.config.federation.secagg_threshold,
                    secagg_neighbours=self.config.federation.secagg_neighbours,
                )
                if peer in member_ids:
                    changes["secagg_members"] = encoded
                    changes["send_key_shares"] = peer not in ctx.key_shares
                    ctx.members_sent.add(peer)
            self.transport.send(peer, ctx.round_open.model_copy(update=changes))

    def _ready(self, ctx: _Attempt) -> set[str]:
        """Invited, reachable participants that count toward the quorum."""
        reachable = ctx.invited & set(self.transport.peers())
        if self._masked:
            return {m.pid for m in ctx.members or []} & reachable
        if self.config.federation.require_binding:
            return {p for p in reachable if self.registry.is_bound(p)}
        return reachable

    def _open(self, ctx: _Attempt) -> None:
        quorum = self.config.federation.quorum
        deadline = self.transport.now() + self.config.federation.open_timeout + ctx.grace
        while len(ready := self._ready(ctx)) < quorum:
            remaining = deadline - self.transport.now()
            if remaining <= 0 and self._masked and ctx.members is None:
                self._fix_members(ctx, final=True)
                if ctx.members is not None:
                    self._invite(ctx)
                    continue
            if remaining <= 0:
                what = "bound" if self.config.federation.require_binding else "reachable"
                raise FaultToleranceExceeded(
                    f"{len(ready)} of quorum {quorum} participants {what} by the open timeout"
                )
            self._ingest(self.transport.recv(timeout_s=min(remaining, _DISCOVERY_INTERVAL)), ctx)
            self._fix_members(ctx)
            self._invite(ctx)

    def _collect(self, ctx: _Attempt) -> None:
        quorum = self.config.federation.quorum
        deadline = self.transport.now() + self.config.federation.collect_timeout + ctx.grace
        while True:
            self._invite(ctx)  # a participant that became reachable may still contribute
            reachable = set(self.transport.peers())
            eligible = {m.pid for m in ctx.members} if ctx.members is not None else ctx.invited
            outstanding = (eligible & reachable) - ctx.admitted - set(ctx.refused)
            if not outstanding:
                break
            if len(ctx.admitted) + len(outstanding) < quorum:
                raise FaultToleranceExceeded(
                    f"{len(ctx.admitted)} updates and {len(outstanding)} reachable "
                    f"participants left; quorum {quorum} cannot be met"
                )
            remaining = deadline - self.transport.now()
            if remaining <= 0:
                break
            self._ingest(self.transport.recv(timeout_s=remaining), ctx)
        if len(ctx.admitted) < quorum:
            raise FaultToleranceExceeded(
                f"{len(ctx.admitted)} updates by the collect deadline, quorum {quorum}"
            )
        self.registry.persist()  # the bindings this round's sum rests on

    def _ingest(self, payload: WirePayload | None, ctx: _Attempt) -> None:
        """Validate and admit one payload; errors whose response is to reject the message
        are logged and counted, every other error propagates and aborts the round."""
        if payload is None:
            return
        try:
            self._accept(from_wire(payload), ctx)
        except LensembleError as exc:
            if response_to(exc) is not Response.REJECT_MESSAGE:
                raise
            ctx.rejected += 1
            log.warning(
                "round %d: message rejected (%s): %s", ctx.machine.round, type(exc).__name__, exc
            )

    def _accept(self, msg: ControlMessage, ctx: _Attempt) -> None:
        if not isinstance(msg, (Commitment, Update, Refusal, UnmaskResponse)):
            raise RoundError(f"a participant may not send {msg.kind} (from {msg.sender})")
        if msg.run_id != self.run_id:
            raise RoundError(f"{msg.sender}: message of run {msg.run_id!r}")
        if (msg.round, msg.attempt) != (ctx.machine.round, ctx.machine.attempt):
            self._check_replay(msg)
            ctx.late.add(msg.sender)
            log.info(
                "round %d: late %s from %s (round %d attempt %d) dropped",
                ctx.machine.round,
                msg.kind,
                msg.sender,
                msg.round,
                msg.attempt,
            )
            return
        pid = msg.participant_id
        fields = canonical_fields(msg)  # hashes an update's arrays: once, here
        self.registry.check_signature(msg, ctx.state.sketch_seed, fields)
        collecting = ctx.machine.state in (RoundState.OPEN, RoundState.COLLECTING)
        if isinstance(msg, UnmaskResponse):
            if not isinstance(ctx.aggregator, SecureAggregator) or collecting:
                raise RoundError(f"{pid}: unexpected unmask response")
            ctx.aggregator.disclose(pid, _parse_shares(msg))
        elif isinstance(msg, Update) and not collecting:
            ctx.late.add(pid)  # the contributing set is frozen: never admitted
            log.info(
                "round %d: update from %s after collection closed, dropped", ctx.machine.round, pid
            )
        elif isinstance(msg, Refusal):
            ctx.refused[pid] = f"{msg.error}: {msg.reason}"
            log.warning(
                "round %d: %s releases nothing: %s", ctx.machine.round, pid, ctx.refused[pid]
            )
            error = reported(msg.error, f"{pid}: {msg.reason}")
            if error is not None and response_to(error) is Response.STOP_FEDERATION:
                raise error  # fail closed, as the error table says (a spent budget, a leak)
        elif isinstance(msg, Commitment):
            self.registry.bind(msg)
        else:
            if pid in ctx.admitted:
                raise DuplicateMessage(f"{pid}: a second update in round {msg.round}; refused")
            self.registry.check_binding(msg)
            self._check_privacy(msg)
            if ctx.sketch_fingerprint is not None:
                check_sketch(msg, ctx.sketch_fingerprint)
            if ctx.aggregator is None:
                raise RoundError(f"{pid}: update before the masked round's members were fixed")
            msg_received = msg  # the ledger records the update as it was received
            if ctx.transform is not None:  # plaintext research harness only
                msg = ctx.transform(msg)
            members = {m.pid for m in ctx.members or []}
            if msg.key_shares and pid in members:
                # Durable before anything else can fail or crash: a member seals its
                # mask-key shares once per member set and sends them again only when a
                # RoundOpen says the coordinator lacks them (send_key_shares).
                assert ctx.members is not None
                ctx.key_shares[pid] = self.registry.store_shares(pid, ctx.members, msg.key_shares)
            ctx.aggregator.admit(msg, weight=self.config.federation.weight_of(msg.num_examples))
            ctx.admitted.add(pid)
            ctx.roots[pid] = msg.dataset_root
            ctx.epsilon[pid] = msg.epsilon
            ctx.update_digests[pid] = message_digest(msg_received, fields)

    def _check_replay(self, msg: ControlMessage) -> None:
        """A message of another attempt is late, never admitted; if it is an exact copy
        of an update the manifest records as admitted in its attempt, it is a replay.

        Raises:
            ReplayedMessage: the copy of an admitted update.
        """
        if not isinstance(msg, Update):
            return
        for entry in self._manifest.rounds:
            if (entry.round, entry.attempt) == (msg.round, msg.attempt):
                if entry.update_digests.get(msg.participant_id) == message_digest(msg):
                    raise ReplayedMessage(
                        f"{msg.participant_id}: update of round {msg.round} attempt "
                        f"{msg.attempt} was admitted then; the copy is refused"
                    )
                return

    def _check_privacy(self, update: Update) -> None:
        """Refuse an update that did not go through the release stages the config requires
        (a stock ClientApp, or a participant configured without them). This checks what
        the participant declares; that the declaration is honest is its signature's job."""
        privacy = self.config.privacy
        needed = [
            stage
            for stage, on in (("clip", privacy.clip_norm > 0), ("gaussian_noise", privacy.noised))
            if on
        ]
        missing = [stage for stage in needed if stage not in update.transforms]
        if missing:
            raise UnprivatizedContribution(
                f"{update.participant_id}: update released without {missing}, which the "
                "configuration requires; refused"
            )

    def _unmask(self, ctx: _Attempt, aggregator: SecureAggregator) -> None:
        """The disclosure exchange of a masked round: one request to every survivor, then
        their answers until all came or the collect timeout passed."""
        requests = aggregator.disclosure_requests()
        # The dropped members' mask keys are about to be reconstructed: record that before
        # asking, so that no restart can forget it and admit those keys again.
        self.registry.revealed(aggregator.dropped)
        for holder, request in requests.items():
            sealed = {**request.self_mask_shares, **request.mask_key_shares}
            self.transport.send(
                holder,
                UnmaskRequest(
                    run_id=self.run_id,
                    round=ctx.machine.round,
                    attempt=ctx.machine.attempt,
                    sender=COORDINATOR,
                    survivors=request.survivors,
                    dropped=request.dropped,
                    sealed={s: c.hex() for s, c in sealed.items()},
                ),
            )
        deadline = self.transport.now() + self.config.federation.collect_timeout
        waiting = set(requests)
        while waiting and (remaining := deadline - self.transport.now()) > 0:
            payload = self.transport.recv(timeout_s=remaining)
            self._ingest(payload, ctx)
            waiting -= set(aggregator.disclosed)

    def _aggregate(self, ctx: _Attempt) -> AggregateSum:
        """Reveal and self-check the sum; a mismatch is re-summed once, a second one raises."""
        aggregator = ctx.aggregator
        assert aggregator is not None
        if isinstance(aggregator, SecureAggregator):
            self._unmask(ctx, aggregator)
        result = aggregator.reveal()
        try:
            aggregator.verify(result)
        except NonDeterministicAggregation as exc:
            log.warning("self-check mismatch, re-summing once: %s", exc)
            result = aggregator.reveal()
            aggregator.verify(result)
        return result

    def _commit(
        self,
        ctx: _Attempt,
        result: AggregateSum,
        mean: NamedArrays,
        diagnostics: Mapping[str, float],
    ) -> None:
        t, prior = ctx.machine.round, ctx.state
        params, momentum = outer_step(prior.params, self._momentum, mean, self.config.outer)
        new_state = self._pin(t + 1, params, copy=False)  # outer_step's arrays are fresh
        digest = self.store.put(
            encode_checkpoint(t + 1, new_state.params, momentum, params_hash=new_state.params_hash)
        )
        stored = decode_checkpoint(self.store.get(digest))
        if stored.params_hash != new_state.params_hash:
            raise CheckpointIntegrityError(f"round {t}: stored checkpoint does not read back")
        # the manifest entry first, so that a crash right after the commit loses nothing
        ctx.closing = self._entry(ctx, result, diagnostics, None, new_state.params_hash)
        save_closing(self.store, ctx.closing)
        entry = ctx.closing  # what the record shares with the manifest comes from it
        record = self._ledger.append(
            ContributionRecord(
                **entry.model_dump(include=_RECORDED_FROM_ENTRY),
                previous_global_hash=entry.prior_global_hash,
                frame_drift=entry.diagnostics.get("frame_drift"),
                dataset_roots={p: ctx.roots[p] for p in entry.contributors},
                epsilon={p: ctx.epsilon.get(p) for p in entry.contributors},
                checkpoint=digest,
                previous_record_hash=self._head_hash,
            )
        )
        # The commit: the only place the canonical state changes.
        self._global, self._momentum, self._head_hash = new_state, momentum, record.record_hash
        self.last_close = RoundClose(
            run_id=self.run_id,
            round=t,
            sender=COORDINATOR,
            previous_hash=prior.params_hash,
            global_hash=new_state.params_hash,
            contributors=result.contributors,
            record_hash=record.record_hash,
        )
        self.transport.broadcast(self.last_close)

    def _record(
        self,
        ctx: _Attempt,
        result: AggregateSum | None,
        diagnostics: dict[str, float],
        error: LensembleError | None,
        started: float,
    ) -> RoundOutcome:
        closed = ctx.machine.state is RoundState.CLOSED
        contributors = result.contributors if result is not None else ()
        outcome = RoundOutcome(
            round=ctx.machine.round,
            attempt=ctx.machine.attempt,
            state=ctx.machine.state,
            error=error,
            count=len(contributors),
            contributors=contributors,
            late=tuple(sorted(ctx.late)),
            rejected=ctx.rejected,
            global_hash=self._global.params_hash,
            diagnostics=diagnostics,
            elapsed=self.transport.now() - started,
            path=(RoundState.OPEN, *(after for _, _, after in ctx.machine.history)),
        )
        entry = ctx.closing if closed else self._entry(ctx, result, diagnostics, outcome.reason)
        assert entry is not None  # a CLOSED attempt went through _commit
        self._manifest = self._manifest.with_round(self.store, entry)
        self.outcomes.append(outcome)
        if self._on_round is not None:
            self._on_round(outcome)
        return outcome

    def _entry(
        self,
        ctx: _Attempt,
        result: AggregateSum | None,
        diagnostics: Mapping[str, float],
        reason: str | None,
        new_global_hash: str | None = None,
    ) -> RoundEntry:
        """The manifest entry of an attempt (closed when ``new_global_hash`` is given)."""
        closed = new_global_hash is not None
        return RoundEntry(
            round=ctx.machine.round,
            attempt=ctx.machine.attempt,
            state="closed" if closed else "aborted",
            reason=reason,
            round_seed=ctx.state.sketch_seed,
            prior_global_hash=ctx.state.params_hash,
            contributors=result.contributors if result is not None else (),
            count=result.count if result is not None else 0,
            total_weight=result.total_weight if result is not None else 0,
            update_digests=dict(sorted(ctx.update_digests.items())),
            aggregate_digest=result.digest if result is not None else None,
            new_global_hash=new_global_hash,
            late=tuple(sorted(ctx.late)),
            rejected=ctx.rejected,
            refused=dict(sorted(ctx.refused.items())),
            secure_sum=closed and isinstance(ctx.aggregator, SecureAggregator),
            diagnostics=dict(diagnostics),
        )

    def _wait_for_joins(self) -> None:
        """Give (re)joining participants ``retry_wait`` seconds; drop what arrives."""
        deadline = self.transport.now() + self.config.federation.retry_wait
        while (remaining := deadline - self.transport.now()) > 0:
            payload = self.transport.recv(timeout_s=remaining)
            if payload is not None:
                log.info("between attempts: dropped a %s", dict(payload).get("kind", "message"))
