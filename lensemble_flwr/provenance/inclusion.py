"""Proof bundles: a participant shows an auditor that one record is in the dataset it
committed to, without handing over the rest.

A participant commits to its data once, by the Merkle root of the records its trainer's
``dataset_records()`` yields (in that order); every ledger record names that root for
each contributor. To show that a given record was part of the committed dataset, the
participant builds an :class:`InclusionProof` from its records and an index
(:func:`prove_inclusion`); the auditor checks it against the root the ledger recorded for
that participant (:func:`check_against_ledger`). The bundle reveals the one record and
``ceil(log2 N)`` sibling hashes, nothing else about the dataset. A hiding commitment's
bundle also carries that one leaf's salt (never the participant's secret), without which
the leaf could not be recomputed.

What a bundle proves: the record is a leaf of the committed tree. The index is exact only
relative to the tree's size, which the ledger does not record (the same record hash can
sit at the same place in trees of several sizes), so an auditor who needs the position
must get the size from the participant's commitment by other means.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import CommitmentMismatch, LedgerError
from lensemble_flwr.provenance.ledger import first_error
from lensemble_flwr.provenance.merkle import (
    inclusion_proof_and_root,
    leaf_hash,
    leaf_salt,
    verify_inclusion,
)
from lensemble_flwr.provenance.verify import verify

FORMAT = "lensemble-inclusion-proof/1"
_HEX64 = r"^[0-9a-f]{64}$"


class InclusionProof(BaseModel):
    """Everything an auditor needs to check that one record is in a committed dataset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["lensemble-inclusion-proof/1"] = FORMAT
    participant_id: str | None = Field(None, description="Who claims the record (informative).")
    record: str = Field(description="The record's bytes, base64.")
    salt: str | None = Field(
        None, pattern=_HEX64, description="The leaf's salt (a hiding commitment), hex."
    )
    leaf_hash: str = Field(pattern=_HEX64, description="The record's Merkle leaf hash.")
    index: int = Field(ge=0)
    size: int = Field(ge=1, description="Records in the committed dataset.")
    siblings: tuple[str, ...] = Field(description="Sibling hashes, leaf to root.")
    root: str = Field(pattern=_HEX64, description="The dataset root the proof leads to.")

    @classmethod
    def from_json(cls, data: str | bytes) -> InclusionProof:
        """Parse a bundle.

        Raises:
            CommitmentMismatch: not a well-formed bundle.
        """
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise CommitmentMismatch(
                f"not an inclusion proof bundle ({FORMAT}): {first_error(exc)}"
            ) from None

    def to_json(self) -> str:
        """The bundle as indented JSON text (what :meth:`from_json` parses)."""
        return self.model_dump_json(indent=2) + "\n"

    def record_bytes(self) -> bytes:
        """The record the bundle is about.

        Raises:
            CommitmentMismatch: ``record`` is not base64.
        """
        try:
            return base64.b64decode(self.record, validate=True)
        except (binascii.Error, ValueError):
            raise CommitmentMismatch("the bundle's record is not valid base64") from None

    def check(self) -> None:
        """Check that the bundle is internally sound: the record hashes to ``leaf_hash`` and
        the siblings lead from it to ``root``.

        Raises:
            CommitmentMismatch: either does not hold.
        """
        record = self.record_bytes()
        salt = None if self.salt is None else bytes.fromhex(self.salt)
        if leaf_hash(record, salt) != self.leaf_hash:
            raise CommitmentMismatch(
                f"the bundle's record hashes to leaf {leaf_hash(record, salt)}, "
                f"not to its stated leaf {self.leaf_hash}"
            )
        verify_inclusion(record, self.index, self.size, self.siblings, self.root, salt)


def prove_inclusion(
    records: Iterable[bytes],
    index: int,
    *,
    participant_id: str | None = None,
    secret: bytes | None = None,
) -> InclusionProof:
    """The participant's side: a bundle proving ``records[index]`` is in their commitment.

    Args:
        records: the same records, in the same order, as the trainer's
            ``dataset_records()`` (the order fixes the root).
        index: which record to prove.
        participant_id: recorded in the bundle for the auditor's convenience.
        secret: the participant's commitment secret (a hiding commitment, as every
            Participant makes; read it with ``read_commitment_secret`` of
            :mod:`lensemble_flwr.provenance.commitment_secret`); None for an unsalted tree.
            Only the one leaf's salt goes into the bundle.

    Raises:
        ValueError: ``records`` is empty.
        IndexError: ``index`` is out of range.
    """
    rows = list(records)
    if not rows:
        raise ValueError("cannot prove anything about an empty dataset")
    siblings, root = inclusion_proof_and_root(rows, index, secret)
    salt = None if secret is None else leaf_salt(secret, index)
    return InclusionProof(
        participant_id=participant_id,
        record=base64.b64encode(rows[index]).decode("ascii"),
        salt=None if salt is None else salt.hex(),
        leaf_hash=leaf_hash(rows[index], salt),
        index=index,
        size=len(rows),
        siblings=tuple(siblings),
        root=root,
    )


@dataclasses.dataclass(frozen=True)
class ProofCheck:
    """An accepted bundle: whose dataset, which root, and the rounds it was bound in."""

    participant_id: str
    root: str
    index: int
    size: int
    rounds: tuple[int, ...]


def committed_root(store: Store, participant_id: str) -> tuple[str, tuple[int, ...]]:
    """The dataset root a verified ledger records for ``participant_id``, and the rounds
    in which it contributed.

    Raises:
        LedgerError: the ledger does not verify, the participant never contributed, or
            its records name more than one root.
        CommitmentMismatch: the participant's contributions were unbound (no root).
    """
    records = verify(store)
    rounds = tuple(r.round for r in records if participant_id in r.contributors)
    if not rounds:
        raise LedgerError(f"{participant_id!r} contributed to no round of this run")
    roots = {r.dataset_roots.get(participant_id) for r in records if r.round in rounds}
    if None in roots:
        raise CommitmentMismatch(
            f"{participant_id!r} contributed unbound updates: the ledger holds no dataset root"
        )
    if len(roots) != 1:
        raise LedgerError(f"the ledger names {len(roots)} dataset roots for {participant_id!r}")
    return str(roots.pop()), rounds


def check_against_ledger(proof: InclusionProof, store: Store, participant_id: str) -> ProofCheck:
    """The auditor's side: accept ``proof`` only if it leads to the root the run's ledger
    recorded for ``participant_id``.

    Raises:
        LedgerError: as for :func:`committed_root`.
        CommitmentMismatch: the bundle's root is not the ledger's root for the participant,
            or the proof does not lead to it.
    """
    root, rounds = committed_root(store, participant_id)
    if proof.root != root:
        raise CommitmentMismatch(
            f"the bundle's root {proof.root} is not the dataset root {root} "
            f"the ledger records for {participant_id!r}"
        )
    proof.check()
    return ProofCheck(participant_id, root, proof.index, proof.size, rounds)
