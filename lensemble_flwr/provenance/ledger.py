"""The contribution ledger, the run manifest, and the check that a run directory is intact.

Every CLOSED round appends one :class:`ContributionRecord` whose hash covers the hash of
the record before it, so rewriting any past round breaks every later link. Records are
stored as blobs and *claimed* under ``ledger/<round>``: a round can be recorded once.
The :class:`RunManifest` lists every attempt of every round, closed or aborted, with the
inputs that make the outer step a pure function (prior global hash, round seed,
contributing set and C_t, update digests). It is stored as a header (written once) and
one claimed entry per attempt, so recording an attempt costs the same in round 1000 as
in round 1. Neither holds a timestamp or a path: two runs with the same seeds and inputs
have the same manifest digest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json, digest_record
from lensemble_flwr.errors import CheckpointIntegrityError, LedgerError, StoreError

GENESIS = "0" * 64
MANIFEST_HEADER = "manifest/header"
MANIFEST_ROUNDS = "manifest/rounds"


def _ledger_name(round: int) -> str:
    return f"ledger/{round:08d}"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ContributionRecord(_Frozen):
    """What one CLOSED round consumed and produced, chained to the record before it."""

    round: int = Field(ge=0)
    attempt: int = Field(ge=1)
    contributors: tuple[str, ...]
    count: int = Field(ge=1, description="C_t")
    total_weight: int = Field(ge=1)
    dataset_roots: dict[str, str | None] = Field(
        description="Each contributor's committed dataset root; None for an unbound one."
    )
    update_digests: dict[str, str]
    epsilon: dict[str, float | None] = Field(
        default_factory=dict,
        description="Each contributor's cumulative epsilon after its release (None: no DP).",
    )
    aggregate_digest: str
    previous_global_hash: str
    new_global_hash: str
    checkpoint: str = Field(description="Store digest of the θ_{t+1} checkpoint blob.")
    round_seed: int
    frame_drift: float | None = Field(
        None, description="Gauge diagnostic of the round (None: no gauge adapter)."
    )
    previous_record_hash: str
    record_hash: str = ""

    def expected_hash(self) -> str:
        """The hash this record must carry: over every field but ``record_hash``."""
        return digest_record("ledger-record", self.model_dump(mode="json", exclude={"record_hash"}))

    def sealed(self) -> ContributionRecord:
        """A copy whose ``record_hash`` is filled in."""
        return self.model_copy(update={"record_hash": self.expected_hash()})


class RoundEntry(_Frozen):
    """One attempt of one round, as the manifest records it."""

    round: int
    attempt: int
    state: Literal["closed", "aborted"]
    reason: str | None = None
    round_seed: int
    prior_global_hash: str
    contributors: tuple[str, ...] = ()
    count: int = 0
    total_weight: int = 0
    update_digests: dict[str, str] = {}
    aggregate_digest: str | None = None
    new_global_hash: str | None = None
    late: tuple[str, ...] = ()
    rejected: int = 0
    refused: dict[str, str] = {}
    secure_sum: bool = False  # the outer step consumed a revealed masked sum
    diagnostics: dict[str, float] = {}


class _Header(_Frozen):
    run_id: str
    config: dict[str, Any]
    root_seed: int
    initial_params_hash: str
    initial_checkpoint: str


class RunManifest(_Frozen):
    """The configuration, seeds and per-round inputs of a run."""

    run_id: str
    config: dict[str, Any]
    root_seed: int
    initial_params_hash: str
    initial_checkpoint: str
    rounds: tuple[RoundEntry, ...] = ()

    @property
    def digest(self) -> str:
        """SHA-256 of the whole manifest (header and every entry) in canonical encoding."""
        return digest_record("manifest", self.model_dump(mode="json"))

    def start(self, store: Store) -> None:
        """Write the header of a new run (refused if the store already holds one)."""
        header = canonical_json(self.model_dump(mode="json", exclude={"rounds"}))
        if not store.claim(MANIFEST_HEADER, store.put(header)):
            raise LedgerError(f"{store.root} already holds a run manifest")
        for entry in self.rounds:
            self._store_entry(store, entry)

    def with_round(self, store: Store, entry: RoundEntry) -> RunManifest:
        """Record one more attempt, durably; returns the extended manifest."""
        self._store_entry(store, entry)
        return self.model_copy(update={"rounds": (*self.rounds, entry)})

    @staticmethod
    def _store_entry(store: Store, entry: RoundEntry) -> None:
        name = f"{MANIFEST_ROUNDS}/{entry.round:08d}-{entry.attempt:04d}"
        if not store.claim(name, store.put(canonical_json(entry.model_dump(mode="json")))):
            raise LedgerError(f"round {entry.round} attempt {entry.attempt} is already recorded")

    @classmethod
    def load(cls, store: Store) -> RunManifest:
        """The run's manifest as stored. Raises StoreError or LedgerError."""
        header = _parse(_Header, store.get(store.resolve(MANIFEST_HEADER)), "manifest header")
        entries = tuple(
            _parse(RoundEntry, store.get(store.resolve(name)), name)
            for name in store.bound(MANIFEST_ROUNDS)
        )
        return cls(**dict(header), rounds=entries)


def _parse(model: type[BaseModel], data: bytes, what: str) -> Any:
    try:
        return model.model_validate(json.loads(data))
    except (ValidationError, ValueError) as exc:
        raise LedgerError(f"{what} does not parse: {exc}") from None


class Ledger:
    """The append-only, hash-chained list of ContributionRecords in a store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._head: ContributionRecord | None = None

    def records(self) -> list[ContributionRecord]:
        """All records in round order (as stored; :func:`verify` checks them)."""
        return [
            _parse(ContributionRecord, self.store.get(self.store.resolve(name)), name)
            for name in self.store.bound("ledger/")
        ]

    def head(self) -> ContributionRecord | None:
        """The newest record, or None before the first CLOSED round."""
        if self._head is not None:
            return self._head  # what this Ledger appended last (appends are claims)
        names = self.store.bound("ledger/")
        if not names:
            return None
        return _parse(ContributionRecord, self.store.get(self.store.resolve(names[-1])), names[-1])

    def append(self, record: ContributionRecord) -> ContributionRecord:
        """Seal ``record`` onto the chain and store it.

        Raises:
            LedgerError: ``record`` does not follow the head (wrong previous hash or round),
                or its round was already recorded.
        """
        head = self.head()
        expected_prev = head.record_hash if head else GENESIS
        expected_round = head.round + 1 if head else record.round
        if record.previous_record_hash != expected_prev or record.round != expected_round:
            raise LedgerError(
                f"record for round {record.round} does not follow the ledger head "
                f"(round {head.round if head else None})"
            )
        sealed = record.sealed()
        digest = self.store.put(canonical_json(sealed.model_dump(mode="json")))
        if not self.store.claim(_ledger_name(sealed.round), digest):
            raise LedgerError(f"round {sealed.round} is already recorded")
        self._head = sealed
        return sealed


def verify(store: Store) -> list[ContributionRecord]:
    """Check a run's ledger chain, checkpoints and manifest against each other.

    Returns:
        The verified records, in round order.

    Raises:
        LedgerError: naming the first broken link (a record hash, a chain link, a
            checkpoint that does not match its record, a manifest that disagrees).
    """
    manifest = RunManifest.load(store)
    try:
        initial = decode_checkpoint(store.get(manifest.initial_checkpoint))
    except (CheckpointIntegrityError, StoreError) as exc:
        raise LedgerError(f"initial checkpoint: {exc}") from None
    if initial.params_hash != manifest.initial_params_hash:
        raise LedgerError("initial checkpoint does not match the manifest's initial params hash")
    records = Ledger(store).records()

    def check_checkpoint(rec: ContributionRecord) -> None:
        try:
            ckpt = decode_checkpoint(store.get(rec.checkpoint))
        except (CheckpointIntegrityError, StoreError) as exc:
            raise LedgerError(f"round {rec.round}: checkpoint: {exc}") from None
        if ckpt.params_hash != rec.new_global_hash or ckpt.round != rec.round + 1:
            raise LedgerError(
                f"round {rec.round}: checkpoint does not hold the recorded new global state"
            )

    _verify_links(records, manifest, check_checkpoint)
    return records


def verify_chain(records: list[ContributionRecord], manifest: RunManifest) -> None:
    """The checks of :func:`verify` that read no checkpoint: every record's hash, the
    chain of record and global hashes from the manifest's θ_0, and the agreement of the
    ledger with the manifest's closed rounds.

    Raises:
        LedgerError: naming the first broken link.
    """
    _verify_links(records, manifest, lambda _rec: None)


def _verify_links(
    records: list[ContributionRecord],
    manifest: RunManifest,
    check_record: Callable[[ContributionRecord], None],
) -> None:
    prev_record, prev_global = GENESIS, manifest.initial_params_hash
    for rec in records:
        where = f"round {rec.round}"
        if rec.record_hash != rec.expected_hash():
            raise LedgerError(f"{where}: record hash does not match its contents")
        if rec.previous_record_hash != prev_record:
            raise LedgerError(f"{where}: chain broken (previous record hash differs)")
        if rec.previous_global_hash != prev_global:
            raise LedgerError(f"{where}: previous global hash is not the prior round's new hash")
        check_record(rec)
        if rec.count != len(rec.contributors) or set(rec.update_digests) != set(rec.contributors):
            raise LedgerError(f"{where}: contributing set and C_t disagree")
        prev_record, prev_global = rec.record_hash, rec.new_global_hash
    closed = {e.round: e for e in manifest.rounds if e.state == "closed"}
    if sorted(closed) != [r.round for r in records]:
        raise LedgerError(
            f"manifest closed rounds {sorted(closed)} differ from ledger rounds "
            f"{[r.round for r in records]}"
        )
    for rec in records:
        entry = closed[rec.round]
        if (entry.aggregate_digest, entry.contributors, entry.new_global_hash) != (
            rec.aggregate_digest,
            rec.contributors,
            rec.new_global_hash,
        ):
            raise LedgerError(f"round {rec.round}: manifest and ledger disagree")
