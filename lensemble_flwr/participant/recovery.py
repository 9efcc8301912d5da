"""A (re)joining participant's recovery of the latest committed global state, verified.

The ledger is checked as a chain, not only its head: every record's hash and its links
back to the manifest's θ_0 (a forged, resealed head would otherwise pass with a
checkpoint to match), and the newest RoundClose the participant received — the head it
trusts — must be in it, with the same record and global hash.
"""

from __future__ import annotations

import logging

from lensemble_flwr.artifacts.checkpoint import Checkpoint, decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import CheckpointIntegrityError, LedgerError
from lensemble_flwr.identity.endorsement import RecordEndorsement, check_endorsed
from lensemble_flwr.protocol.messages import RoundClose
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    ContributionRecord,
    Ledger,
    RunManifest,
    load_external_step,
)
from lensemble_flwr.provenance.verify import record_breaks, verify_chain

log = logging.getLogger(__name__)


def _check_last_link(records: list[ContributionRecord], manifest: RunManifest) -> None:
    """The newest record's own hash and its links to the record and state before it (the
    ledger's own link rules, :func:`~lensemble_flwr.provenance.verify.record_breaks`).

    Raises:
        LedgerError: the first broken link.
    """
    before = records[-2] if len(records) > 1 else None
    breaks = record_breaks(
        records[-1],
        previous_record_hash=before.record_hash if before else GENESIS,
        previous_global_hash=before.new_global_hash if before else manifest.initial_params_hash,
    )
    first = next(iter(breaks), None)
    if first is not None:
        raise LedgerError(first.message)


def _check_trusted_head(
    records: list[ContributionRecord], trusted: RoundClose | None, participant_id: str
) -> None:
    """The round ``trusted`` announced is in the ledger, with the same record and hash.

    Raises:
        CheckpointIntegrityError: it is not.
    """
    if trusted is None:
        return
    seen = next((r for r in records if r.round == trusted.round), None)
    if seen is None or (seen.record_hash, seen.new_global_hash) != (
        trusted.record_hash,
        trusted.global_hash,
    ):
        raise CheckpointIntegrityError(
            f"the run's ledger does not hold round {trusted.round} as it was "
            f"announced to {participant_id} (record {trusted.record_hash[:12]}…)"
        )


def _check_pinned_head(
    head: ContributionRecord | None,
    expect_head: str | None,
    reviews: list[RecordEndorsement],
    *,
    pinned: bool,
    by: str,
) -> None:
    """The newest record is the pinned one (``expect_head``); one that nothing pins
    (neither ``expect_head`` nor a RoundClose: ``pinned``) and nobody endorsed yet is
    joined with a warning naming it.

    Raises:
        LedgerError: it is not the pinned one (or there is none).
    """
    found = head.record_hash if head is not None else None
    if expect_head is not None and found != expect_head:
        raise LedgerError(
            f"ledger head: record_hash: expected {expect_head}, found {found} "
            "(the newest record is not the pinned one)"
        )
    if head is not None and expect_head is None and not pinned and reviews[-1].status == "pending":
        log.warning(
            "%s: joins at round %d, whose record %s… is not yet endorsed: only as "
            "trustworthy as the run directory (pin it with expect_head)",
            by,
            head.round,
            head.record_hash[:12],
        )


def recover_checkpoint(
    store: Store,
    trusted: RoundClose | None,
    participant_id: str,
    expect_head: str | None = None,
) -> Checkpoint:
    """The checkpoint of the run's latest committed global state (or of the model an
    external step adopted in its place), verified against the ledger.

    Args:
        store: the coordinator's artifact store (its run directory).
        trusted: the newest RoundClose the participant received (None: none yet).
        participant_id: for the error messages.
        expect_head: the record hash the newest record must carry (held outside the run
            directory: an operator's pin); None: not pinned.

    Raises:
        CheckpointIntegrityError: the checkpoint's bytes or params do not match the hash
            the ledger (or manifest) records for it, or the ledger does not hold the
            round the participant saw closed.
        LedgerError: the ledger's chain is broken, a record lacks the endorsements its
            policy requires (identity/endorsement.py), or the head is not ``expect_head``.
    """
    records = Ledger(store).records()
    manifest = RunManifest.load(store)
    _check_trusted_head(records, trusted, participant_id)
    closed = {e.round for e in manifest.rounds if e.state is RoundState.CLOSED}
    if records and records[-1].round not in closed:
        # committed, its manifest entry not yet written (a coordinator that crashed right
        # after its commit point, before resume completes it): the chain is checked up to
        # the record before, and the last record's own links
        verify_chain(records[:-1], manifest)
        _check_last_link(records, manifest)
    else:
        verify_chain(records, manifest)
    reviews = check_endorsed(store, records, manifest.endorsement, config=manifest.config)
    head = records[-1] if records else None
    _check_pinned_head(head, expect_head, reviews, pinned=trusted is not None, by=participant_id)
    if head is None:
        digest, expected = manifest.initial_checkpoint, manifest.initial_params_hash
    else:
        digest, expected = head.checkpoint, head.new_global_hash
    step = load_external_step(store)
    if step is not None and step.committed_hash == expected:
        # the next round trains from the model an external step adopted (a wrapper's
        # central noise): a joiner gets that one, never the model it replaced
        digest, expected = step.checkpoint, step.adopted_hash
    checkpoint = decode_checkpoint(store.get(digest))
    if checkpoint.params_hash != expected:
        raise CheckpointIntegrityError(
            f"recovered checkpoint {digest[:12]}… does not hold the recorded global state"
        )
    return checkpoint
