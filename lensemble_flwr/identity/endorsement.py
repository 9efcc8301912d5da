"""Endorsements: the participants' signatures on the ledger records they checked.

The ledger's hash chain shows that no record was changed *after* the next one was
written; it cannot show who wrote a record, so whoever can write the run directory can
rewrite the chain from any round on, reseal every hash, and every link holds. An
endorsement closes that: a participant that holds an identity key signs the hash of a
record it has checked (:func:`endorse`), and a record counts only once enough of the
participants it names have signed it. A forger without their keys cannot.

Where endorsements come from (the run's policy, recorded in its manifest header):

* ``"next-round"`` (in process, on Flower): a participant signs the record of the newest
  RoundClose it received and sends the signature inside its next Commitment or Update
  (``endorses``, ``endorsement``: covered by the message's own signature). The
  coordinator checks it against the participant's registered key when it admits the
  message, and the next record carries it (``ContributionRecord.endorsements``), so the
  endorsements are hash-chained too. The newest record (the head) has none yet.
* ``"on-write"`` (the shared folder, whose writer is itself a participant): as above, and
  every participant also deposits its endorsement of each record it read and checked
  under ``endorsements/<round>/<participant>`` (:func:`deposit_endorsement`); the writer
  deposits its own before it announces the record, so the head is endorsed too.

The policy (:func:`endorsement_review`): a record's *keyed contributors* are its
contributors that hold an identity key anywhere in the run: any registry a record names,
the current registry, the reader's allow-list (:func:`.keyless.run_keys`). A record
before the head is endorsed when at least ``min(K // 2 + 1, R)`` of its K keyed
contributors signed its hash, where R counts those of them that contributed to the next
record (one that took no part in it had no message to carry its endorsement in:
requiring it would refuse every untouched run with a drop-out; with R = 0 the record is,
like the head, not yet endorsed). Under ``"on-write"`` at least one registered
participant must have signed every record, the head included. A record none of whose
contributors holds a key cannot be endorsed: it is reported as ``keyless`` (its history
rests on its writer alone), and refused only where an honest run could not have written
it (:func:`.keyless.keyless_breaks`: no registry named though its contributors hold keys
or are bound, keyless contributors under ``require-signatures``, unbound ones under
``require-binding``). A run written before endorsements existed (no policy in its
header) is reported as ``legacy``.

Every endorsement found is checked: one that is not its participant's signature of that
record is a broken link, whether it is carried in a record or deposited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import digest_record
from lensemble_flwr.errors import ForgedMessage, LedgerError, StoreError
from lensemble_flwr.identity.keyless import keyless_breaks, run_keys
from lensemble_flwr.identity.signing import IdentityKey, digest_signed_by
from lensemble_flwr.protocol.messages import RoundClose
from lensemble_flwr.provenance.ledger import (
    ENDORSED_ON_WRITE,
    ContributionRecord,
    EndorsementPolicy,
    RunManifest,
)
from lensemble_flwr.provenance.verify import LinkBreak, verify

ENDORSEMENTS = "endorsements"
"""Store names ``endorsements/<round>/<participant>``: a participant's deposited
endorsement of that round's record (its signature, hex)."""

Status = Literal["endorsed", "pending", "keyless", "unendorsed", "legacy"]


def endorsement_name(round: int, participant: str) -> str:
    """The store name a participant's deposited endorsement of ``round`` is bound under."""
    return f"{ENDORSEMENTS}/{round:08d}/{participant}"


def endorsement_digest(record_hash: str) -> bytes:
    """What an endorsement signs: the record's hash under a domain tag of its own (so an
    endorsement is never a message signature, nor one a message signature)."""
    return bytes.fromhex(digest_record("ledger-endorsement", {"record_hash": record_hash}))


def endorse(key: IdentityKey, record_hash: str) -> str:
    """``key``'s endorsement (a signature, hex) of the record whose hash is ``record_hash``."""
    return key.sign_digest(endorsement_digest(record_hash))


def endorsement_fields(key: IdentityKey | None, last_close: RoundClose | None) -> dict[str, str]:
    """The endorsement fields of a participant's next Commitment or Update: its key's
    signature of the record of the newest RoundClose it received (the record it checked
    last); none without a key or a close."""
    if key is None or last_close is None:
        return {}
    record = last_close.record_hash
    return {"endorses": record, "endorsement": endorse(key, record)}


def endorsed_by(public_key: str | None, record_hash: str, signature: str) -> bool:
    """Whether ``signature`` is ``public_key``'s endorsement of ``record_hash`` (False for
    no key, or a key that is not a usable identity key)."""
    if public_key is None:
        return False
    try:
        return digest_signed_by(public_key, endorsement_digest(record_hash), signature)
    except ForgedMessage:
        return False


def deposit_endorsement(
    store: Store, record: ContributionRecord, participant: str, key: IdentityKey
) -> None:
    """Deposit ``participant``'s endorsement of ``record`` (once: a second deposit of the
    same participant for the same round, e.g. after a restart, leaves the first)."""
    name = endorsement_name(record.round, participant)
    if not store.bound(name):
        store.claim(name, store.put(endorse(key, record.record_hash).encode("ascii")))


def deposited_endorsements(store: Store, round: int) -> dict[str, str]:
    """The endorsements deposited for ``round``'s record: participant → signature (a
    deposit that cannot be read is returned as an empty signature, which never verifies).
    """
    found: dict[str, str] = {}
    prefix = f"{ENDORSEMENTS}/{round:08d}/"
    for name in store.bound(prefix.rstrip("/")):
        participant = name[len(prefix) :]
        try:
            found[participant] = store.get(store.resolve(name)).decode("ascii").strip()
        except (StoreError, UnicodeDecodeError):
            found[participant] = ""
    return found


@dataclasses.dataclass(frozen=True)
class RecordEndorsement:
    """What the run's evidence says about one record's endorsement.

    Attributes:
        round: the record's round.
        record_hash: its hash.
        keyed: its contributors with a registered identity key.
        required: how many of them must have signed it (the policy).
        endorsers: who signed it, each checked against their registered key.
        status: ``endorsed``; ``pending`` (not yet: the head of a ``"next-round"`` run,
            or a record none of whose keyed contributors took part in the next round);
            ``keyless`` (no contributor holds a key: nobody can endorse it);
            ``unendorsed`` (fewer than ``required``: refused); ``legacy`` (a run written
            before endorsements).
    """

    round: int
    record_hash: str
    keyed: tuple[str, ...]
    required: int
    endorsers: tuple[str, ...]
    status: Status

    @property
    def missing(self) -> tuple[str, ...]:
        """The keyed contributors that did not sign."""
        return tuple(p for p in self.keyed if p not in self.endorsers)

    def describe(self) -> str:
        """One line: the status and who signed (what ``verify`` and ``show`` print)."""
        signed = ", ".join(self.endorsers) or "nobody"
        if self.status == "endorsed":
            return f"endorsed by {signed} ({len(self.endorsers)} of {len(self.keyed)} keyed)"
        if self.status == "pending":
            return f"not yet endorsed (no keyed contributor took part since; signed by {signed})"
        if self.status == "keyless":
            return "cannot be endorsed: no contributor holds an identity key"
        if self.status == "legacy":
            return "not endorsed: the run was written before endorsements"
        among = ", ".join(self.keyed) or "the registered participants"
        return f"UNENDORSED: needs {self.required} of {among}, signed by {signed}"


def _endorsers(
    rec: ContributionRecord,
    carried: Mapping[str, str],
    deposited: Mapping[str, str],
    keys: Mapping[str, str],
    where: str,
) -> tuple[set[str], list[LinkBreak]]:
    """Who validly signed ``rec``, and a break for each endorsement that is not a
    signature of it by its participant's registered key."""
    signers: set[str] = set()
    breaks: list[LinkBreak] = []
    for source, found in (("carried", carried), ("deposited", deposited)):
        for pid, signature in sorted(found.items()):
            if endorsed_by(keys.get(pid), rec.record_hash, signature):
                signers.add(pid)
                continue
            place = (
                f"{where} carries" if source == "carried" else f"{endorsement_name(rec.round, pid)}"
            )
            breaks.append(
                LinkBreak(
                    rec.round,
                    f"endorsement.{pid}",
                    f"{pid}'s signature of record {rec.record_hash[:12]}…",
                    "a signature its registered key did not make"
                    if pid in keys
                    else "a participant with no registered key",
                    f"round {rec.round}: FORGED endorsement: {place} an endorsement of "
                    f"record {rec.record_hash[:12]}… in {pid}'s name that {pid}'s "
                    "registered identity key did not sign",
                )
            )
    return signers, breaks


def endorsement_review(
    store: Store,
    records: Sequence[ContributionRecord],
    policy: EndorsementPolicy | None,
    *,
    config: Mapping[str, Any] | None = None,
    identities: Mapping[str, str] | None = None,
) -> tuple[list[RecordEndorsement], list[LinkBreak]]:
    """Every record's endorsement under the run's ``policy`` (see the module docstring),
    and the broken links: records forged to pass as keyless
    (:func:`~lensemble_flwr.identity.keyless.keyless_breaks`), forged endorsements and
    records endorsed by fewer than the policy requires.

    Args:
        store: the run's store (registries and deposited endorsements).
        records: the run's ledger records, in round order, already checked as a chain.
        policy: the manifest header's ``endorsement`` (None: a run written before them).
        config: the manifest header's recorded config (``require-signatures``,
            ``require-binding``; None: neither).
        identities: the allow-list the reader holds from outside the run, if any.
    """
    keys = run_keys(store, records, identities)
    reviews: list[RecordEndorsement] = []
    breaks: list[LinkBreak] = []
    if policy is not None:
        breaks += keyless_breaks(store, records, config or {}, identities)
    for i, rec in enumerate(records):
        following = records[i + 1] if i + 1 < len(records) else None
        carried = (following.endorsements or {}) if following is not None else {}
        deposited = deposited_endorsements(store, rec.round)
        where = f"round {following.round}'s record" if following is not None else ""
        signers, forged = _endorsers(rec, carried, deposited, keys, where)
        breaks += forged
        keyed = tuple(p for p in rec.contributors if p in keys)
        endorsers = tuple(sorted(signers))
        status, required = _status(rec, following, keyed, signers, policy)
        review = RecordEndorsement(rec.round, rec.record_hash, keyed, required, endorsers, status)
        reviews.append(review)
        if status == "unendorsed":
            breaks.append(
                LinkBreak(
                    rec.round,
                    "endorsements",
                    f"{required} of {list(keyed) or 'any registered participant'}",
                    list(endorsers),
                    f"round {rec.round}: ledger record {rec.record_hash[:12]}… is UNENDORSED, "
                    "so FORGED by someone without its participants' keys: it needs the "
                    f"endorsement of {required} of "
                    f"{', '.join(keyed) or 'the registered participants'}; "
                    f"missing {', '.join(review.missing) or 'any signature'}",
                )
            )
    return reviews, breaks


def _status(
    rec: ContributionRecord,
    following: ContributionRecord | None,
    keyed: tuple[str, ...],
    signers: set[str],
    policy: EndorsementPolicy | None,
) -> tuple[Status, int]:
    """The record's status and how many keyed contributors must have signed it."""
    if policy is None:
        return "legacy", 0
    on_write = policy == ENDORSED_ON_WRITE
    if not keyed and not on_write:
        return "keyless", 0
    signed = len(signers & set(keyed))
    majority = len(keyed) // 2 + 1 if keyed else 0
    if following is None:  # the head
        if on_write:  # its writer endorsed it before announcing it
            return ("endorsed" if signers else "unendorsed"), 1
        return ("endorsed" if keyed and signed >= majority else "pending"), 0
    returning = len(set(keyed) & set(following.contributors))
    required = min(majority, returning)
    if on_write:
        ok = bool(signers) and signed >= required
        return ("endorsed" if ok else "unendorsed"), max(required, 1)
    if required == 0 and not signed:  # none of them took part since: like the head
        return "pending", 0
    return ("endorsed" if signed >= max(required, 1) else "unendorsed"), max(required, 1)


def check_endorsed(
    store: Store,
    records: Sequence[ContributionRecord],
    policy: EndorsementPolicy | None,
    *,
    config: Mapping[str, Any] | None = None,
    identities: Mapping[str, str] | None = None,
) -> list[RecordEndorsement]:
    """:func:`endorsement_review`, raising on the first broken link (what a resume, a
    joining participant and a shared-folder reader run).

    Raises:
        LedgerError: naming the record and the endorsements it lacks, a forged one, or
            what makes a record that passes as keyless a forgery.
    """
    reviews, breaks = endorsement_review(
        store, records, policy, config=config, identities=identities
    )
    for broken in breaks:
        raise LedgerError(broken.message)
    return reviews


def verify_run(store: Store, *, expect_head: str | None = None) -> list[RecordEndorsement]:
    """:func:`~lensemble_flwr.provenance.verify.verify`, then every record's endorsement
    under the run's policy, and the newest record against ``expect_head`` when given (a
    hash held outside the run directory).

    Returns:
        Every record's endorsement, in round order.

    Raises:
        LedgerError: the first broken link, a forged endorsement, a record endorsed by
            fewer participants than its policy requires (naming the record and who is
            missing), or a head that is not ``expect_head``.
    """
    records = verify(store)
    header = RunManifest.load(store)
    reviews = check_endorsed(store, records, header.endorsement, config=header.config)
    found = records[-1].record_hash if records else None
    if expect_head is not None and found != expect_head:
        raise LedgerError(f"ledger head: record_hash: expected {expect_head}, found {found}")
    return reviews
