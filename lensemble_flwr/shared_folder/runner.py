"""Rounds over a shared folder: the same script on every node and no coordinator process.

On a cluster where every job mounts the same filesystem, each participant process runs::

    node = SharedFolderParticipant(folder, config=config, participant_id=my_id,
                                   trainer=my_trainer, participants=all_ids,
                                   initial_params=theta_0, run_id="demo")
    state = node.run(rounds=10)            # the global state after round 10

and that is the whole deployment. Per sitting of a round (see :mod:`.barrier`):

1. every process reads the sitting's announcement (the global checkpoint and the
   RoundOpen the coordinator would send it), lets its :class:`Participant` answer, and
   deposits the answer — Commitment and Update, or a Refusal — with its size;
2. whoever finds every record there claims the decision. Exactly one wins, and its
   :class:`~.decision.SittingDecider` restores the coordinator from the run's store
   (:meth:`Coordinator.resume`) and feeds the records into the same admission step as
   every other feeder (:meth:`Coordinator.conclude_collected`, as the Flower strategy's
   ``aggregate_train`` does): quorum, self-check, outer step, checkpoint, ledger record.
   It publishes the outcome and the next announcement;
3. everybody else waits for that outcome and goes on from it, so all of them leave a round
   with the same global state, the one in the ledger.

The first process to arrive creates the run (``Coordinator(...)``, the usual way) and
announces round 1. A process that arrives late walks the published outcomes to the
sitting in progress without waiting on any of them, and one restarted after depositing
does not deposit twice. A sitting that was not complete by the deadline is decided
without the missing participants: by default that is a :class:`RoundIncomplete` naming
them (tried again in a new sitting, up to ``max-round-attempts``); with ``quorum`` set, the
coordinator runs on the records that are there. An attempt the coordinator aborts is
retried (or stops the run) exactly as :meth:`Coordinator.run` would, by the error table.

Masked rounds are refused: secure aggregation needs an unmask exchange after the updates,
which a one-shot deposit does not carry.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import (
    AggregatorFactory,
    Coordinator,
    fixed_point_aggregator,
)
from lensemble_flwr.coordinator.modes import mode_for, require_exchange
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    ConfigError,
    ForgedMessage,
    LedgerError,
    RoundError,
)
from lensemble_flwr.identity.endorsement import deposit_endorsement
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.identity.signing import IdentityKey, parse_public_key
from lensemble_flwr.participant.local_training import LocalTraining, Trainer
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.messages import RoundClose, WirePayload, to_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import (
    ENDORSED_BY_NEXT_ROUND,
    ENDORSED_ON_WRITE,
    ContributionRecord,
    RunManifest,
    ledger_name,
    parse_document,
)
from lensemble_flwr.release import ReleaseTransform
from lensemble_flwr.shared_folder.barrier import FolderBarrier, SittingKey
from lensemble_flwr.shared_folder.decision import (
    Decision,
    SittingDecider,
    rebuild_error,
    round_opens,
)
from lensemble_flwr.shared_folder.endorsing import check_round_endorsed, committed_record
from lensemble_flwr.shared_folder.records import (
    Announcement,
    FolderRecord,
    Genesis,
    Outcome,
    decode_genesis,
    decode_outcome,
    decode_record,
    encode,
    encode_record,
    update_of,
)
from lensemble_flwr.shared_folder.signed import FolderSeal
from lensemble_flwr.transports.base import ReplyCollector

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9._-]+")


class SharedFolderParticipant:
    """One participant process of a federation that meets in a shared folder.

    Args:
        folder: the folder every process mounts; the run lives in ``runs/<run_id>/``.
        config: the federation's config (every process must pass the same; the run's
            recorded config is checked).
        participant_id: this process's participant, one of ``participants``.
        trainer: its private data and model (a Trainer or any LocalTraining).
        participants: every participant of the run, the same list in every process.
        initial_params: θ_0; only the process that creates the run uses it.
        run_id: names the run; runs sharing a folder never see each other.
        pipeline: the participant's release pipeline (the config's by default).
        quorum: None: a sitting needs every participant's record, and a deadline without
            them is a :class:`RoundIncomplete`. An int: at the deadline, the round goes on
            with the records that are there if they are at least this many (the
            coordinator's own quorum applies on top).
        round_timeout: seconds a sitting may take to complete (default: the config's open
            plus collect timeouts).
        publish_timeout: seconds a decider may take to publish (default: the config's
            collect timeout).
        poll_interval: seconds between looks at the folder.
        aggregator_factory: passed to the coordinator when this process decides.
        on_outcome: called with the outcome of every sitting this process goes through.
        identity: this participant's private identity key, which signs what it writes.
        identities: every participant's public identity key (OpenSSH), the same in every
            process; every document read from the folder is checked against it.
        unauthenticated: run without ``identity`` and ``identities``, accepting that
            anyone who can write the folder can act for anyone.

    Attributes:
        decisions: the sittings this process decided (at most one process decides each).
        deposits: the sittings this process deposited a record in.

    Raises:
        ConfigError: a participant list, id, run id or quorum that cannot work, a masked
            (secure-aggregation) config, or identity keys that do not fit together.
    """

    _answer: tuple[tuple[int, int], list[WirePayload]] | None = None
    """The payloads this participant answered its last attempt (round, attempt) with."""
    _endorsed_on_write = False
    """The run endorses every record as it is written (set when joining it; a run started
    by an earlier version, without endorsements, is read as it was)."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        config: LensembleConfig,
        participant_id: str,
        trainer: Trainer | LocalTraining,
        participants: Sequence[str],
        initial_params: Mapping[str, np.ndarray],
        run_id: str = "lensemble-run",
        pipeline: ReleaseTransform | None = None,
        quorum: int | None = None,
        round_timeout: float | None = None,
        publish_timeout: float | None = None,
        poll_interval: float = 0.05,
        aggregator_factory: AggregatorFactory = fixed_point_aggregator,
        on_outcome: Callable[[Outcome], None] | None = None,
        identity: IdentityKey | None = None,
        identities: Mapping[str, str] | None = None,
        unauthenticated: bool = False,
    ) -> None:
        everyone = tuple(participants)
        _check_setup(folder, config, run_id, participant_id, everyone, quorum, aggregator_factory)
        self.identities = _check_identities(
            identity, identities, participant_id, everyone, unauthenticated=unauthenticated
        )
        self.config = config
        self.participant_id = participant_id
        self.participants = tuple(sorted(everyone))
        self.run_id = run_id
        self.quorum = quorum
        self.store = Store(Path(folder) / "runs" / run_id)
        self.identity = f"{participant_id} (pid {os.getpid()} on {socket.gethostname()})"
        self.barrier = _barrier(
            self.store, self.identity, config, round_timeout, publish_timeout, poll_interval
        )
        self._outbox = ReplyCollector()
        self.participant = Participant(
            config,
            participant_id=participant_id,
            transport=self._outbox,
            trainer=trainer,
            pipeline=pipeline,
            identity=identity,  # its messages are signed: the decider's coordinator checks
        )
        self._initial_params = initial_params
        self._aggregator_factory = aggregator_factory
        self._on_outcome = on_outcome
        self._seal = FolderSeal(run_id, participant_id, identity, self.identities)
        self._decider = SittingDecider(
            config,
            store=self.store,
            participants=self.participants,
            quorum=quorum,
            decided_by=self.identity,
            seal=self._seal,
            aggregator_factory=aggregator_factory,
        )
        self.decisions: list[Decision] = self._decider.decisions
        self.deposits: list[SittingKey] = []

    # -- the loop ------------------------------------------------------------------------
    def run(self, rounds: int) -> GlobalState:
        """Take part until the run has closed ``rounds`` rounds; return that global state.

        ``rounds`` counts from the start of the run, so every process (and one restarted
        half-way) agrees on where to stop.

        Raises:
            RoundIncomplete: a sitting's deadline passed without some participants, and
                the round may not be tried again.
            ClaimantDied: a sitting (or the run's start) was claimed and never published.
            LensembleError: the error of an attempt that stopped the run (the decider
                published it; every process raises the same).
        """
        if rounds < 0:
            raise ValueError("rounds must be >= 0")
        announcement = self._join()
        while announcement.round <= rounds:  # Flower's numbering: rounds 1 … rounds
            key = SittingKey(announcement.round, announcement.sitting)
            published = self.barrier.outcome(key)
            if published is None:  # the sitting is still open: answer it, then wait
                self._deposit(key, announcement)
                published = self.barrier.gather(
                    key, self.participants, self._decider.for_sitting(announcement)
                )
            outcome = decode_outcome(self._seal.open(published, f"{key.name}/outcome"))
            if (outcome.run_id, outcome.round, outcome.sitting) != (
                self.run_id,
                key.round,
                key.sitting,
            ):
                raise LedgerError(f"{key}: the published outcome is about another sitting")
            self._check_endorsed(key)
            self._check_outcome(key, outcome)
            if outcome.state is RoundState.CLOSED:
                self._endorse(key)
            if self._on_outcome is not None:
                self._on_outcome(outcome)
            if outcome.next is None:
                log.error("%s: the run stops: %s: %s", key, outcome.error, outcome.reason)
                raise rebuild_error(outcome)
            if outcome.state is not RoundState.CLOSED:
                log.warning(
                    "%s %s (%s); the round is tried again", key, outcome.state, outcome.reason
                )
            announcement = outcome.next
        return self._state(announcement)

    # -- joining -------------------------------------------------------------------------
    def _join(self) -> Announcement:
        genesis = decode_genesis(self._seal.open(self.barrier.start(self._create), "genesis"))
        if genesis.run_id != self.run_id:
            raise ConfigError("run_id", f"the folder's run is {genesis.run_id!r}")
        if genesis.participants != self.participants:
            raise ConfigError(
                "participants",
                f"the run was started with {list(genesis.participants)}, "
                f"this process has {list(self.participants)}",
            )
        manifest = RunManifest.load(self.store)
        self.config.check_recorded(manifest.config)
        self._endorsed_on_write = manifest.endorsement == ENDORSED_ON_WRITE
        return genesis.first

    def _create(self) -> bytes:
        """Start the run (this process won its start claim) and announce round 1."""
        coordinator = Coordinator(
            self.config,
            initial_params=self._initial_params,
            store=self.store,
            run_id=self.run_id,
            aggregator_factory=self._aggregator_factory,
            identities=self.identities,
            # its writer is a participant: every record is endorsed as it is written
            endorsement=(
                ENDORSED_ON_WRITE if self.identities is not None else ENDORSED_BY_NEXT_ROUND
            ),
        )
        first = Announcement.of(
            round_opens(coordinator, self.participants),
            sitting=1,
            checkpoint=coordinator.manifest.initial_checkpoint,
        )
        genesis = Genesis(
            run_id=self.run_id,
            participants=self.participants,
            created_by=self.identity,
            first=first,
        )
        return self._seal.sign(encode(genesis), "genesis")

    # -- a participant's half ------------------------------------------------------------
    def answer(self, announcement: Announcement) -> FolderRecord:
        """The record this participant deposits for the announced sitting: its
        Participant's answer to the RoundOpen, and its size when updates are weighed by
        example counts (None under uniform weighting)."""
        opened = announcement.round_opens[self.participant_id]
        attempt = (announcement.round, int(opened["attempt"]))
        if self._answer is None or self._answer[0] != attempt:
            # a new attempt; a sitting retried without one (somebody never came) gets the
            # same answer again, since a participant answers each attempt only once
            params = self._checkpoint_params(announcement)
            self.participant.handle(announcement.round_open(self.participant_id, params))
            self._answer = (attempt, self._outbox.take())
        payloads = self._answer[1]
        update = update_of(payloads)
        weighs = self.config.federation.weighting == "num-examples"
        return FolderRecord(
            run_id=self.run_id,
            round=announcement.round,
            sitting=announcement.sitting,
            participant=self.participant_id,
            num_examples=int(update["num_examples"]) if update is not None and weighs else None,
            payloads=tuple(dict(p) for p in payloads),
        )

    def _deposit(self, key: SittingKey, announcement: Announcement) -> None:
        slot = f"{key.name}/record/{self.participant_id}"
        if self.barrier.has_deposited(key, self.participant_id):
            # a restart finds its own record; anything else in its slot is somebody
            # acting for it, and it says so loudly instead of being left out quietly
            name = self.barrier.record_name(key, self.participant_id)
            existing = self.store.get(self.store.resolve(name))
            try:
                decode_record(self._seal.open(existing, slot, author=self.participant_id))
            except (ForgedMessage, RoundError) as exc:
                raise ForgedMessage(
                    f"{key}: the slot of {self.participant_id} holds a record it did not "
                    f"write: {exc}"
                ) from None
            log.info("%s: %s already deposited (a restart)", key, self.participant_id)
            return
        self.barrier.deposit(key, self.participant_id, self.seal_record(self.answer(announcement)))
        self.deposits.append(key)

    def seal_record(self, record: FolderRecord, sitting: SittingKey | None = None) -> bytes:
        """The bytes this participant deposits for ``record``: encoded, and signed for its
        slot of ``sitting`` (default: the record's own; unless the run is unauthenticated)."""
        key = sitting or SittingKey(record.round, record.sitting)
        return self._seal.sign(encode_record(record), f"{key.name}/record/{self.participant_id}")

    # -- checking what was published --------------------------------------------------
    def _check_outcome(self, key: SittingKey, outcome: Outcome) -> None:
        """A closed outcome must be what the ledger holds: its global state and the next
        announcement's checkpoint are the ledger record's.

        Raises:
            LedgerError: they are not (an outcome that leads everybody off the ledger).
        """
        if outcome.state is not RoundState.CLOSED:
            return
        name = ledger_name(key.round)
        record = (
            parse_document(ContributionRecord, self.store.get(self.store.resolve(name)), name)
            if self.store.bound(name)
            else None
        )
        if (
            record is None
            or record.new_global_hash != outcome.global_hash
            or (outcome.next is not None and outcome.next.checkpoint != record.checkpoint)
        ):
            raise LedgerError(
                f"{key}: the published outcome says the round closed on "
                f"{outcome.global_hash[:12]}…, which is not what the ledger records"
            )

    def _check_endorsed(self, key: SittingKey) -> None:
        """The round's ledger record, if there is one, is endorsed by a participant (an
        unauthenticated run, or one started before endorsements, has none to check).

        Raises:
            LedgerError: it is endorsed by nobody (forged; the message names it).
            ForgedMessage: a deposited endorsement is forged.
        """
        if self._endorsed_on_write and self._seal.identities is not None:
            check_round_endorsed(self.store, key.round, self._seal.identities)

    def _endorse(self, key: SittingKey) -> None:
        """This participant checked the closed round's record (its endorsement and the
        outcome): it deposits its endorsement, and its Participant hears the round's
        close, so its next Commitment or Update endorses the record too."""
        record = committed_record(self.store, key.round)
        assert record is not None  # _check_outcome
        if self._seal.key is not None and self._seal.identities is not None:
            deposit_endorsement(self.store, record, self.participant_id, self._seal.key)
        close = RoundClose(
            run_id=self.run_id,
            round=record.round,
            sender="shared-folder",
            previous_hash=record.previous_global_hash,
            global_hash=record.new_global_hash,
            count=record.count,
            record_hash=record.record_hash,
        )
        self.participant.handle(to_wire(close))

    # -- state ---------------------------------------------------------------------------
    def _checkpoint_params(self, announcement: Announcement) -> dict[str, np.ndarray]:
        checkpoint = decode_checkpoint(self.store.get(announcement.checkpoint))
        if (
            checkpoint.params_hash != announcement.params_hash
            or checkpoint.round != announcement.round - 1  # round r starts from θ_{r-1}
        ):
            raise CheckpointIntegrityError(
                f"round {announcement.round}: the announced checkpoint does not hold the "
                "announced global state"
            )
        return checkpoint.params

    def _state(self, announcement: Announcement) -> GlobalState:
        return GlobalState.create(
            announcement.round - 1,  # θ_{r-1}, the state round r starts from
            self._checkpoint_params(announcement),
            sketch_seed=derive_seed(self.config.federation.root_seed, "round", announcement.round),
            h_steps=self.config.inner.steps,
        )


def _barrier(
    store: Store,
    identity: str,
    config: LensembleConfig,
    round_timeout: float | None,
    publish_timeout: float | None,
    poll_interval: float,
) -> FolderBarrier:
    """The run's barrier for this process; its deadlines default to the config's open
    plus collect timeouts (a sitting) and collect timeout (a decider's publishing)."""
    fed = config.federation
    return FolderBarrier(
        store,
        identity=identity,
        round_timeout=fed.open_timeout + fed.collect_timeout
        if round_timeout is None
        else round_timeout,
        publish_timeout=fed.collect_timeout if publish_timeout is None else publish_timeout,
        poll_interval=poll_interval,
    )


def _check_setup(
    folder: str | os.PathLike[str],
    config: LensembleConfig,
    run_id: str,
    participant_id: str,
    everyone: tuple[str, ...],
    quorum: int | None,
    aggregator_factory: AggregatorFactory,
) -> None:
    """Refuse a participant process that cannot work, before anything is written.

    Raises:
        ConfigError: a participant list with repeats or none, a run id or participant
            that is not a folder name, a participant id not in the list, a masked
            (secure-aggregation) config, or a quorum out of range.
    """
    if not everyone or len(set(everyone)) != len(everyone):
        raise ConfigError("participants", "must be a non-empty list without repeats")
    for field, names in (("run_id", [run_id]), ("participants", everyone)):
        bad = [n for n in names if not _NAME.fullmatch(n) or n in (".", "..")]
        if bad:
            raise ConfigError(field, f"{bad} are not folder names ([A-Za-z0-9._-]+)")
    if participant_id not in everyone:
        raise ConfigError("participant_id", f"{participant_id!r} is not a participant")
    # The decider feeds the coordinator a batch of deposits, which carries no unmask
    # exchange: the coordinator refuses a masked round there (conclude_collected), but
    # only once the records are deposited. Its own refusal is asked here, on the mode
    # the config selects, so the same error comes before anything is written.
    require_exchange(
        mode_for(
            config,
            ParticipantRegistry(config, Store(Path(folder) / "runs" / run_id, create=False)),
            run_id=run_id,
            aggregator_factory=aggregator_factory,
        ),
        None,
    )
    if quorum is not None and not 1 <= quorum <= len(everyone):
        raise ConfigError("quorum", f"must be between 1 and {len(everyone)}, got {quorum}")


def _check_identities(
    identity: IdentityKey | None,
    identities: Mapping[str, str] | None,
    me: str,
    everyone: Sequence[str],
    *,
    unauthenticated: bool,
) -> dict[str, str] | None:
    """The federation's allow-list of identity keys, checked (None: unauthenticated).

    Raises:
        ConfigError: no allow-list and no explicit ``unauthenticated``; an allow-list that
            does not name exactly the participants, holds a key that does not parse, or
            does not hold this participant's own key.
    """
    if identities is None:
        if not unauthenticated:
            raise ConfigError(
                "identities",
                "a shared folder authenticates nothing by itself (every participant can "
                "write it): give every participant's public identity key (identities=) and "
                "this one's key (identity=), or unauthenticated=True to accept that anyone "
                "who can write the folder can act for anyone",
            )
        log.warning(
            "shared folder %s UNAUTHENTICATED: anyone who can write the folder can act for "
            "any participant",
            me,
        )
        return None
    if set(identities) != set(everyone):
        raise ConfigError("identities", f"must name exactly the participants {sorted(everyone)}")
    for pid, key in identities.items():
        try:
            parse_public_key(key)
        except ForgedMessage as exc:
            raise ConfigError(f"identities[{pid}]", str(exc)) from None
    if identity is None or identity.public_openssh.strip() != identities[me].strip():
        raise ConfigError(
            "identity", f"must be {me}'s private key, whose public half is in identities"
        )
    return dict(identities)
