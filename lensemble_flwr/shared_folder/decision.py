"""A sitting's decision: what the one process that claimed it does with the records.

The barrier (:mod:`.barrier`) hands the claimant a snapshot of the sitting's records, and
a :class:`SittingDecider` turns it into the sitting's :class:`Outcome`:

1. a snapshot that misses participants, with no quorum or fewer records than it, is a
   :class:`RoundIncomplete` naming them, announced again in a new sitting while the
   round has attempts left;
2. otherwise the records that are readable (signed for their slot, about this run and
   sitting, speaking only for their participant) must agree about sizes
   (:func:`check_sizes`); the coordinator is restored from the run's store
   (:meth:`Coordinator.resume`), must stand where the sitting's announcement says, and
   takes the records' payloads through :meth:`Coordinator.conclude_collected`, as every
   other batch feeder does;
3. a closed round must be the ledger's record, and its outcome announces the next round;
   an aborted attempt announces the next sitting when the error table retries it, and
   stops the run otherwise.

Whatever fails while deciding is published as an aborted outcome, so nobody waits for a
decider that failed; every process raises the published error again, rebuilt by
:func:`rebuild_error`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import lensemble_flwr.errors as errors
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.coordinator.coordinator import AggregatorFactory, Coordinator
from lensemble_flwr.errors import (
    ConfigError,
    ForgedMessage,
    InconsistentSizes,
    LedgerError,
    LensembleError,
    Response,
    RoundError,
    RoundIncomplete,
    response_to,
)
from lensemble_flwr.identity.endorsement import deposit_endorsement
from lensemble_flwr.protocol.messages import RoundOpen, WirePayload
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import ContributionRecord, ledger_name, parse_document
from lensemble_flwr.shared_folder.barrier import Decide, SittingKey, Snapshot
from lensemble_flwr.shared_folder.records import (
    Announcement,
    FolderRecord,
    Outcome,
    OutcomeState,
    decode_record,
    encode,
    update_of,
)
from lensemble_flwr.shared_folder.signed import FolderSeal

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A sitting this process decided, and how."""

    key: SittingKey
    state: OutcomeState
    contributors: tuple[str, ...]


def check_sizes(records: Sequence[FolderRecord]) -> None:
    """Refuse records that disagree about sizes: every record with an update states its
    size or none does, and a stated size is the update's ``num_examples``.

    Raises:
        InconsistentSizes: naming who states a size and who does not, or whose size is
            not its update's.
    """
    answered = [(r, update_of(r.payloads)) for r in records]
    answered = [(r, u) for r, u in answered if u is not None]
    stated = sorted(r.participant for r, _ in answered if r.num_examples is not None)
    silent = sorted(r.participant for r, _ in answered if r.num_examples is None)
    if stated and silent:
        raise InconsistentSizes(
            f"{', '.join(stated)} state their size and {', '.join(silent)} do not: all of "
            "them or none"
        )
    for record, update in answered:
        if record.num_examples is not None and record.num_examples != update.get("num_examples"):
            raise InconsistentSizes(
                f"{record.participant} states size {record.num_examples} and its update "
                f"says {update.get('num_examples')!r}"
            )


def rebuild_error(outcome: Outcome) -> LensembleError:
    """The error a stopped sitting published, as its own type where this package has it."""
    reason = outcome.reason or ""
    if outcome.state == "incomplete":
        return RoundIncomplete(reason, missing=outcome.missing)
    cls = getattr(errors, outcome.error or "", None)
    if cls is ConfigError:
        return ConfigError(outcome.error_field or "config", reason)
    if isinstance(cls, type) and issubclass(cls, LensembleError):
        return cls(reason)
    return LensembleError(
        f"{outcome.decided_by} failed deciding round {outcome.round}: {outcome.error}: {reason}"
    )


def round_opens(coordinator: Coordinator, participants: Sequence[str]) -> dict[str, RoundOpen]:
    """The RoundOpen the coordinator would send each participant now."""
    return {pid: coordinator.round_open_for(pid) for pid in participants}


class SittingDecider:
    """Decides the sittings one participant process claims, and remembers which.

    Args:
        config: the federation's config.
        store: the run's store, where the coordinator is restored from.
        participants: every participant of the run, sorted.
        quorum: how many records a sitting past its deadline needs to go on (None: all).
        decided_by: who this process is, as outcomes name their decider.
        seal: this participant's seal, which checks the records' signatures and signs
            the outcome; its author's RoundOpen in an announcement says the attempt.
        aggregator_factory: passed to the restored coordinator.
    """

    def __init__(
        self,
        config: LensembleConfig,
        *,
        store: Store,
        participants: tuple[str, ...],
        quorum: int | None,
        decided_by: str,
        seal: FolderSeal,
        aggregator_factory: AggregatorFactory,
    ) -> None:
        self.config = config
        self.store = store
        self.participants = participants
        self.quorum = quorum
        self.decided_by = decided_by
        self.seal = seal
        self._aggregator_factory = aggregator_factory
        self._follower = LedgerFollower(store)  # what this process checked of the run
        self.decisions: list[Decision] = []
        """The sittings this process decided (at most one process decides each)."""

    def for_sitting(self, announcement: Announcement) -> Decide:
        """What the barrier calls if this process claims the announced sitting: the
        signed bytes of its outcome, an aborted one if deciding failed."""

        def decide(snapshot: Snapshot) -> bytes:
            try:
                outcome = self.decide(announcement, snapshot)
            except Exception as exc:  # published, so nobody waits for a decider that failed
                if not isinstance(exc, LensembleError):
                    log.exception("%s: deciding failed", snapshot.key)
                outcome = self._outcome(
                    snapshot,
                    RoundState.ABORTED,
                    global_hash=announcement.params_hash,
                    error=exc,
                )
            self.decisions.append(Decision(snapshot.key, outcome.state, outcome.contributors))
            return self.seal.sign(encode(outcome), f"{snapshot.key.name}/outcome")

        return decide

    def decide(self, announcement: Announcement, snapshot: Snapshot) -> Outcome:
        """The outcome of the announced sitting, from the records in ``snapshot``.

        Raises:
            InconsistentSizes: the records disagree about sizes.
            LedgerError: the run's store is not where the sitting announced, or a closed
                round is not the ledger's record.
            LensembleError: anything the coordinator raises before its commit point.
        """
        key, present = snapshot.key, sorted(snapshot.records)
        retry_allowed = key.sitting < self.config.federation.max_round_attempts
        if snapshot.missing and (self.quorum is None or len(present) < self.quorum):
            error = RoundIncomplete(
                f"{key}: no record from {', '.join(snapshot.missing)} by the deadline "
                f"({len(present)} of {len(self.participants)} deposited)",
                missing=snapshot.missing,
            )
            return self._outcome(
                snapshot,
                "incomplete",
                global_hash=announcement.params_hash,
                error=error,
                next=announcement.again() if retry_allowed else None,
            )
        records = self._readable(snapshot)
        check_sizes(records)
        coordinator = self._resume(key, announcement)
        round = announcement.round
        payloads = [payload for record in records for payload in record.payloads]
        # the sitting's announcement already invited them: the invitations are not sent
        coordinator.begin_attempt()
        coordinator.invite(present)
        result = self._conclude(key, round, coordinator, payloads, present)
        if result.state is RoundState.CLOSED:
            head = self._committed_record(round)
            if head is None or head.new_global_hash != result.global_hash:
                raise LedgerError(f"{key}: the ledger does not hold the closed round")
            if self.seal.key is not None and self.seal.identities is not None:
                # before the outcome: a record nobody endorsed is refused by every reader
                deposit_endorsement(self.store, head, self.seal.author, self.seal.key)
            nxt = Announcement.of(
                round_opens(coordinator, self.participants), sitting=1, checkpoint=head.checkpoint
            )
            return self._outcome(
                snapshot,
                RoundState.CLOSED,
                global_hash=result.global_hash,
                contributors=result.contributors,
                next=nxt,
            )
        return self._aborted(snapshot, announcement, coordinator, result, retry_allowed)

    def _resume(self, key: SittingKey, announcement: Announcement) -> Coordinator:
        """The run's coordinator, restored from the store and standing where the sitting
        announced: the round, its global state and the attempt.

        Raises:
            LedgerError: it stands somewhere else.
        """
        coordinator = Coordinator.resume(
            self.config,
            store=self.store,
            aggregator_factory=self._aggregator_factory,
            identities=self.seal.identities,
            follower=self._follower,  # every sitting resumes: checking the whole run each
        )  # time would make it quadratic; each record is checked once per process
        state = coordinator.global_state()
        expected_attempt = announcement.round_opens[self.seal.author]["attempt"]
        if (state.next_round, state.params_hash, coordinator.next_attempt()) != (
            announcement.round,
            announcement.params_hash,
            expected_attempt,
        ):
            raise LedgerError(
                f"{key}: the run's store is at round {state.next_round} attempt "
                f"{coordinator.next_attempt()}, not at what the sitting announced"
            )
        return coordinator

    @staticmethod
    def _conclude(
        key: SittingKey,
        round: int,
        coordinator: Coordinator,
        payloads: Sequence[WirePayload],
        present: Sequence[str],
    ) -> RoundOutcome:
        """The coordinator's outcome of the attempt; a failure past the commit point is
        the closed round it committed."""
        try:
            return coordinator.conclude_collected(payloads, present)
        except Exception:
            # past the commit point (e.g. the manifest entry could not be written): the
            # round is in the ledger, so it is published as closed; the next decider's
            # resume completes the manifest from the entry kept before the commit
            closed = coordinator.outcomes[-1] if coordinator.outcomes else None
            if closed is None or (closed.state, closed.round) != (RoundState.CLOSED, round):
                raise
            log.exception("%s: round %d committed, its manifest entry not written", key, round)
            return closed

    def _aborted(
        self,
        snapshot: Snapshot,
        announcement: Announcement,
        coordinator: Coordinator,
        result: RoundOutcome,
        retry_allowed: bool,
    ) -> Outcome:
        """The outcome of an attempt the coordinator aborted: the next sitting when the
        error table retries the round (and attempts are left), the run's end otherwise."""
        assert result.error is not None
        # the next sitting's decider resumes from the store: the commitments this attempt
        # admitted must be there, since its RoundOpens no longer ask for them
        coordinator.registry.persist()
        retry = response_to(result.error) is Response.RETRY_ROUND and retry_allowed
        nxt = (
            Announcement.of(
                round_opens(coordinator, self.participants),
                sitting=snapshot.key.sitting + 1,
                checkpoint=announcement.checkpoint,
            )
            if retry
            else None
        )
        return self._outcome(
            snapshot,
            RoundState.ABORTED,
            global_hash=result.global_hash,
            error=result.error,
            next=nxt,
        )

    def _committed_record(self, round: int) -> ContributionRecord | None:
        """The ledger record of ``round``, read back by its name (None: there is none)."""
        name = ledger_name(round)
        if not self.store.bound(name):
            return None
        return parse_document(ContributionRecord, self.store.get(self.store.resolve(name)), name)

    def _readable(self, snapshot: Snapshot) -> list[FolderRecord]:
        """The snapshot's records that parse, speak for the participant they are filed
        under, and say they belong to this run and sitting in a header that agrees with
        their payloads; any other is left out (its participant then sent nothing the
        coordinator can admit, as with a message that fails validation).

        A record of another round passes, when its payloads say the same round: the
        coordinator files its sender as late, as it does a late message."""
        key, readable = snapshot.key, []
        for pid, data in sorted(snapshot.records.items()):
            try:
                record = decode_record(self.seal.open(data, f"{key.name}/record/{pid}", author=pid))
            except ForgedMessage as exc:
                log.error("%s: REFUSED the record in the slot of %s: %s", key, pid, exc)
                continue
            except RoundError as exc:
                log.error("%s: record of %s left out, unreadable: %s", key, pid, exc)
                continue
            speakers = {p.get("participant_id") for p in record.payloads}
            if record.participant != pid or not speakers <= {pid}:
                log.warning("%s: record filed under %s speaks for %s", key, pid, speakers)
                continue
            carried = {(p.get("run_id"), p.get("round")) for p in record.payloads}
            if (record.run_id, record.sitting) != (self.seal.run_id, key.sitting) or not (
                carried <= {(record.run_id, record.round)}
            ):
                log.warning(
                    "%s: record filed under %s says run %r round %d sitting %d and carries "
                    "messages of %s; left out",
                    key,
                    pid,
                    record.run_id,
                    record.round,
                    record.sitting,
                    sorted(carried, key=str),
                )
                continue
            readable.append(record)
        return readable

    def _outcome(
        self,
        snapshot: Snapshot,
        state: OutcomeState,
        *,
        global_hash: str,
        contributors: tuple[str, ...] = (),
        error: BaseException | None = None,
        next: Announcement | None = None,
    ) -> Outcome:
        """The outcome this process publishes for the snapshot's sitting."""
        return Outcome(
            run_id=self.seal.run_id,
            round=snapshot.key.round,
            sitting=snapshot.key.sitting,
            state=state,
            decided_by=self.decided_by,
            contributors=contributors,
            missing=snapshot.missing,
            error=None if error is None else type(error).__name__,
            error_field=error.field if isinstance(error, ConfigError) else None,
            reason=None
            if error is None
            else (error.reason if isinstance(error, ConfigError) else str(error))[:2000],
            global_hash=global_hash,
            next=next,
        )
