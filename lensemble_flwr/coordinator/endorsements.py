"""The coordinator's side of endorsements: admitting them with a message, and writing
them into the next ledger record.

A participant's Commitment or Update may carry its endorsement of the ledger record it
checked last (``endorses``, ``endorsement``: covered by the message's own signature,
which admission has already checked). :func:`take_endorsement` keeps it with the attempt
when it is the participant's registered key's signature of a record; :func:`endorsements_of`
hands the next record those that endorse the record it follows (the ledger head), so a
record carries the endorsements of the one before it (:mod:`lensemble_flwr.identity.
endorsement` says what they are for and what the policy asks).
"""

from __future__ import annotations

import logging

from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.identity.endorsement import endorsed_by
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.protocol.messages import ControlMessage

log = logging.getLogger(__name__)


def take_endorsement(attempt: Attempt, msg: ControlMessage, registry: ParticipantRegistry) -> bool:
    """Keep ``msg``'s endorsement with ``attempt`` when it carries one its sender's
    registered identity key made (returns whether it was kept). One that does not check
    is logged and left out: the message itself is authentic (its signature was checked),
    so the participant signed something else, which the record must not carry."""
    endorses = getattr(msg, "endorses", None)
    signature = getattr(msg, "endorsement", None)
    if endorses is None or signature is None:
        return False
    pid = msg.participant_id  # type: ignore[union-attr]
    if not endorsed_by(registry.key_of(pid), endorses, signature):
        log.error(
            "%s: its endorsement of record %s… is not its registered key's signature; "
            "left out",
            pid,
            endorses[:12],
        )
        return False
    attempt.endorsements[pid] = (endorses, signature)
    return True


def endorsements_of(attempt: Attempt, head_hash: str) -> dict[str, str] | None:
    """The endorsements of the record ``head_hash`` that ``attempt`` admitted: participant
    → signature (None when there are none, so a record without any hashes as before)."""
    found = {p: sig for p, (h, sig) in sorted(attempt.endorsements.items()) if h == head_hash}
    stale = sorted(p for p, (h, _) in attempt.endorsements.items() if h != head_hash)
    if stale:
        log.warning(
            "round %d: %s endorsed another record than the ledger head %s… (they did not "
            "hear the last close); not recorded",
            attempt.round,
            ", ".join(stale),
            head_hash[:12],
        )
    return found or None
