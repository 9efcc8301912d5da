"""Endorsing the rounds of a shared folder, and refusing a round nobody endorsed.

Anyone who can write the folder can claim a round's ledger record before its decider
does, with a manifest entry and a checkpoint to match, all consistent. What such a
writer cannot make is a participant's endorsement (its identity key's signature of the
record, :mod:`lensemble_flwr.identity.endorsement`). So a run in a shared folder is
created with the ``"on-write"`` policy: the decider deposits its endorsement of the
record it committed before it publishes the outcome, and every participant deposits its
own once it has checked the record against the outcome. A reader that finds a round's
record with no endorsement of a participant on the federation's allow-list refuses it,
naming it, and so does ``Coordinator.resume`` (and ``lensemble-flwr verify``).
"""

from __future__ import annotations

from collections.abc import Mapping

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ForgedMessage, LedgerError
from lensemble_flwr.identity.endorsement import (
    deposited_endorsements,
    endorsed_by,
    endorsement_name,
)
from lensemble_flwr.provenance.ledger import ContributionRecord, ledger_name, parse_document


def committed_record(store: Store, round: int) -> ContributionRecord | None:
    """The ledger record of ``round``, read by its name (None: there is none)."""
    name = ledger_name(round)
    if not store.bound(name):
        return None
    return parse_document(ContributionRecord, store.get(store.resolve(name)), name)


def check_round_endorsed(
    store: Store, round: int, identities: Mapping[str, str]
) -> ContributionRecord | None:
    """The ledger record of ``round`` (None: there is none), refused unless a participant
    of ``identities`` (the allow-list every process holds from outside the folder)
    endorsed it.

    Raises:
        ForgedMessage: a deposited endorsement is not its participant's signature.
        LedgerError: the record is endorsed by nobody: someone who is no participant
            (or a participant's process that died between its commit and its deposit)
            wrote it; the message names the record.
    """
    record = committed_record(store, round)
    if record is None:
        return None
    signers = []
    for pid, signature in sorted(deposited_endorsements(store, round).items()):
        if not endorsed_by(identities.get(pid), record.record_hash, signature):
            raise ForgedMessage(
                f"{endorsement_name(round, pid)}: not {pid}'s endorsement of round {round}'s "
                f"ledger record {record.record_hash[:12]}… (FORGED endorsement)"
            )
        signers.append(pid)
    if not signers:
        raise LedgerError(
            f"round {round}: ledger record {record.record_hash[:12]}… is UNENDORSED: no "
            "participant endorsed it (its decider endorses it before announcing it), so "
            "it was FORGED by someone who can write the folder; refused (the record, its "
            "manifest entry and its checkpoint are not the run's)"
        )
    return record
