"""Rebuilding a coordinator's committed state from its run directory after a restart.

The newest ledger record names the checkpoint to resume from (θ_t and its momentum),
unless an external step kept after it replaced θ_t (:mod:`.external_step`): then the
adopted model's checkpoint is the one resumed from. A
commit that a crash cut short between the ledger record and the manifest entry is
completed from the closing entry kept before it (:mod:`.durable`); an attempt that
started but never finished is recorded as aborted, so the round is retried under a new
attempt number.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Literal

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.durable import (
    EXTERNAL_STEP,
    closing_name,
    load_closing,
    load_external_step,
    marker_name,
    started_attempts,
    started_from,
)
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.identity.endorsement import check_endorsed
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    ContributionRecord,
    ExternalStep,
    Ledger,
    RoundEntry,
    RunManifest,
    entries_digest,
    ledger_name,
)
from lensemble_flwr.provenance.verify import (
    agreement_breaks,
    verify,
    verify_chain,
    verify_registry,
    verify_resumable,
)

log = logging.getLogger(__name__)

INTERRUPTED = "CoordinatorRestart: the attempt was cut short by a coordinator restart"
"""The reason recorded for an attempt a crash interrupted."""


@dataclasses.dataclass(frozen=True)
class Recovered:
    """The committed state a restarted coordinator continues from."""

    manifest: RunManifest
    round: int
    params: NamedArrays
    momentum: NamedArrays
    head_hash: str
    external_step: ExternalStep | None = None  # how ``params`` replaced the head's model


def recover(
    store: Store,
    manifest: RunManifest,
    check: Literal["full", "chain"],
    identities: Mapping[str, str] | None = None,
) -> Recovered:
    """Complete a cut-short commit, verify the run, and load the checkpoint to resume from
    (``identities``: the coordinator's allow-list, if it has one).

    Raises:
        LedgerError: the ledger, manifest or checkpoint is inconsistent.
    """
    records = Ledger(store).records()
    closed = {e.round for e in manifest.rounds if e.state is RoundState.CLOSED}
    if records and records[-1].round not in closed:
        # committed, but the crash came before its manifest entry
        manifest = _complete_cut_commit(store, manifest, records[-1], manifest.rounds)
    if check == "full":
        verify(store)  # the registry, the round in flight and the kept step too
    else:
        verify_chain(records, manifest)
        verify_registry(store, records)
        verify_resumable(store, records, manifest)
    # a resealed chain is refused, and so is one rewritten to pass as keyless
    check_endorsed(
        store, records, manifest.endorsement, config=manifest.config, identities=identities
    )
    head = records[-1] if records else None
    return _resume_point(store, manifest, head)


def recover_following(
    store: Store, follower: LedgerFollower, identities: Mapping[str, str] | None = None
) -> Recovered:
    """:func:`recover` with ``check="chain"`` for a process that resumes the run again and
    again: only what was stored since ``follower`` last checked is read and checked (the
    same link rules), so a resume costs the same in round 1000 as in round 2.

    Raises:
        LedgerError: the ledger, manifest or checkpoint is inconsistent.
    """
    header = follower.manifest_header()
    before = follower.head
    records = follower.unchecked()
    if records:
        entries = follower.entries(records[-1].round)
        if not any(e.state is RoundState.CLOSED for e in entries):
            _complete_cut_commit(store, header, records[-1], entries)
    window = [before, *records] if before is not None else records
    check_endorsed(  # before anything is followed
        store, window, header.endorsement, config=header.config, identities=identities
    )
    follower.check(records)
    current = follower.entries(follower.through + 1)
    if any(e.state is RoundState.CLOSED for e in current):
        raise LedgerError(
            f"round {follower.through + 1} is closed in the manifest but not in the ledger "
            f"({ledger_name(follower.through + 1)} is missing)"
        )
    follower.check_registry()
    follower.check_resumable(current)
    return _resume_point(store, header.model_copy(update={"rounds": current}), follower.head)


def _complete_cut_commit(
    store: Store, manifest: RunManifest, rec: ContributionRecord, entries: Iterable[RoundEntry]
) -> RunManifest:
    """Write the manifest entry of ``rec``'s round from the closing entry kept before its
    commit (the crash came between the ledger record and the entry), once it is checked
    to be the entry ``rec`` committed to (``entries``: the manifest's, of any round; those
    of ``rec``'s round are the attempts before it). Nothing is written otherwise.

    Raises:
        LedgerError: the kept entry is missing, another round's, or not the one the
            record committed to.
    """
    log.warning("round %d: completing the manifest after a crash", rec.round)
    kept = load_closing(store, rec.round, rec.attempt)
    if kept is None or (kept.round, kept.attempt, kept.new_global_hash) != (
        rec.round,
        rec.attempt,
        rec.new_global_hash,
    ):
        raise LedgerError(
            f"round {rec.round} is in the ledger but not in the manifest, and the "
            "manifest entry kept before its commit is missing or is another round's"
        )
    before = [e for e in entries if e.round == rec.round and e.attempt < rec.attempt]
    if entries_digest([*before, kept]) != rec.entries_digest or any(agreement_breaks(rec, kept)):
        raise LedgerError(
            f"round {rec.round} is in the ledger but not in the manifest, and the entry "
            f"kept before its commit ({closing_name(rec.round, rec.attempt)}) is not the "
            "one the ledger record committed to: nothing was written"
        )
    return manifest.with_round(store, kept)


def _resume_point(
    store: Store, manifest: RunManifest, head: ContributionRecord | None
) -> Recovered:
    """The checkpoint to resume from: the head's (or θ_0's), or the external step kept
    after it."""
    ckpt = decode_checkpoint(store.get(head.checkpoint if head else manifest.initial_checkpoint))
    expected = head.new_global_hash if head else manifest.initial_params_hash
    if ckpt.params_hash != expected:
        raise LedgerError("the checkpoint to resume from does not hold the recorded state")
    step = load_external_step(store)
    if step is not None and step.committed_hash == expected:
        # the next round was to train from a model changed after this commit: so it does
        ckpt = decode_checkpoint(store.get(step.checkpoint))
        if ckpt.params_hash != step.adopted_hash:
            raise LedgerError("the kept external step's checkpoint does not hold its model")
    else:
        step = None  # none kept, or one an earlier round already trained from
    _check_started_from(store, manifest, ckpt.round + 1, step)
    return Recovered(
        manifest=manifest,
        round=ckpt.round,
        params=ckpt.params,
        momentum=ckpt.momentum,
        head_hash=head.record_hash if head else GENESIS,
        external_step=step,
    )


def _check_started_from(
    store: Store, manifest: RunManifest, round: int, step: ExternalStep | None
) -> None:
    """Every attempt of ``round`` that started must have started from the model the
    resume continues from: the kept external step's adopted model (``step``), or the
    committed one (its marker names none).

    Raises:
        LedgerError: a marker names another model: the kept step was written, replaced or
            deleted after the round started.
    """
    finished = [e.attempt for e in manifest.rounds if e.round == round]
    expected = step.adopted_hash if step is not None else None
    for attempt in started_attempts(store, round, at_least=max(finished, default=0)):
        name = marker_name(round, attempt)
        if not store.bound(name):
            continue  # a marker of a run written before markers named the step
        found = started_from(store, round, attempt)
        if found != expected:
            was = f"the model adopted as {found[:12]}…" if found else "the committed model"
            now = "the kept external step's model" if step else "the committed model"
            raise LedgerError(
                f"{EXTERNAL_STEP}: round {round} attempt {attempt} started ({name}) from "
                f"{was}, not from {now}: the kept step was written, replaced or removed "
                "after the round started"
            )


def record_interrupted(
    store: Store,
    manifest: RunManifest,
    state: GlobalState,
    external_step: ExternalStep | None = None,
) -> RunManifest:
    """Record every attempt of the round starting from ``state`` that started but has no
    manifest entry (``external_step``: the one ``state`` was adopted by, if any)."""
    t = state.next_round
    finished = {e.attempt for e in manifest.rounds if e.round == t}
    for attempt in started_attempts(store, t, at_least=max(finished, default=0)):
        if attempt in finished:
            continue
        log.warning("round %d attempt %d was interrupted by a restart", t, attempt)
        manifest = manifest.with_round(
            store,
            RoundEntry(
                round=t,
                attempt=attempt,
                state=RoundState.ABORTED,
                reason=INTERRUPTED,
                round_seed=state.sketch_seed,
                prior_global_hash=state.params_hash,
                external_step=external_step,
            ),
        )
    return manifest
