"""The contribution ledger and the run manifest: their records, their store names, the chain.

Every CLOSED round appends one :class:`ContributionRecord` whose hash covers the hash of
the record before it, so rewriting any past round breaks every later link. Records are
stored as blobs and *claimed* under ``ledger/<round>``: a round can be recorded once.
Rounds are numbered as Flower numbers them: round r (from 1) takes θ_{r-1} to θ_r.
The :class:`RunManifest` lists every attempt of every round, closed or aborted, with the
inputs that make the outer step a pure function (prior global hash, round seed,
contributing set and C_t, update digests). It is stored as a header (written once) and
one claimed entry per attempt, so recording an attempt costs the same in round 1000 as
in round 1. Neither holds a timestamp or a path: two runs with the same seeds and inputs
have the same manifest digest.

What the records must satisfy, and :func:`~lensemble_flwr.provenance.verify.verify`, the
check that a run directory is intact, are in :mod:`lensemble_flwr.provenance.verify`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json, digest_record
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.privacy.guarantee import PrivacyGuarantee
from lensemble_flwr.protocol.round import TerminalState

GENESIS = "0" * 64
LEDGER = "ledger"
MANIFEST_HEADER = "manifest/header"
MANIFEST_ROUNDS = "manifest/rounds"
REGISTRY = "coordinator/participants"
"""The store name of the coordinator's participant registry (identity.registry_store)."""
FRAME_DRIFT = "frame_drift"
"""The manifest diagnostic holding the latent frame's drift over the round, when recorded."""


def ledger_name(round: int) -> str:
    """The store name a round's ledger record is claimed under."""
    return f"{LEDGER}/{round:08d}"


def manifest_entry_name(round: int, attempt: int) -> str:
    """The store name the manifest entry of one attempt of one round is claimed under."""
    return f"{MANIFEST_ROUNDS}/{round:08d}-{attempt:04d}"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExternalStep(_Frozen):
    """A change made to the committed global model outside lensemble, before a round
    trained from it: a wrapping strategy's post-aggregation step, such as the central
    noise of Flower's ``DifferentialPrivacyServerSideFixedClipping``.

    The round's manifest entries and its ledger record carry it, so the chain of global
    hashes stays unbroken: the previous round committed ``committed_hash``, this round
    trained from ``adopted_hash``, and ``checkpoint`` holds the adopted model with the
    momentum the coordinator re-derived from it (the outer optimizer's state depends on
    released models only: see ``coordinator.outer_optimizer.momentum_after_external_step``).
    """

    committed_hash: str = Field(description="The global model the previous round committed.")
    adopted_hash: str = Field(description="The global model this round trained from.")
    checkpoint: str = Field(description="Store digest of the adopted model's checkpoint.")
    change_norm: float = Field(
        ge=0, description="L2 norm of the change, over every floating-point array."
    )


EXTERNAL_STEP = "coordinator/external-step"
"""The store name of the external step the next round trains from (kept before any node
is sent the adopted model)."""


def save_external_step(store: Store, step: ExternalStep) -> None:
    """Keep the external step the next round trains from."""
    store.bind(EXTERNAL_STEP, store.put(canonical_json(step.model_dump(mode="json"))))


def load_external_step(store: Store) -> ExternalStep | None:
    """The last external step kept, or None when none was.

    Raises:
        LedgerError: one was kept and does not parse (nobody may guess which model the
            next round trains from).
    """
    if not store.bound(EXTERNAL_STEP):
        return None
    try:
        return ExternalStep.model_validate_json(store.get(store.resolve(EXTERNAL_STEP)))
    except (ValidationError, ValueError) as exc:
        raise LedgerError(f"the kept external step does not parse: {exc}") from None


PRUNED = "pruned"
"""Store names ``pruned/<digest>``: a checkpoint blob a retention policy removed, bound
(before the blob goes) to a note of the round it held (:mod:`.retention`)."""


def pruned_name(digest: str) -> str:
    """The store name that records that the checkpoint blob ``digest`` was pruned."""
    return f"{PRUNED}/{digest}"


def is_pruned(store: Store, digest: str) -> bool:
    """Whether the checkpoint blob ``digest`` is gone because it was pruned (a marker
    records it, and the blob is absent); a blob that is merely missing is not."""
    return not store.has(digest) and bool(store.bound(pruned_name(digest)))


_ONLY_WHEN_SET = Field(None, exclude_if=lambda value: value is None)
"""An optional field left out of the stored and hashed form while it is unset (records
and entries written before the field existed keep their hashes)."""


class ContributionRecord(_Frozen):
    """What one CLOSED round consumed and produced, chained to the record before it."""

    round: int = Field(ge=1, description="Flower's round number: θ_{round-1} → θ_round.")
    attempt: int = Field(ge=1)
    invited: tuple[str, ...] = Field(
        description="Who the closing attempt invited (its sample, when rounds are sampled)."
    )
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
    checkpoint: str = Field(description="Store digest of the θ_round checkpoint blob.")
    external_step: ExternalStep | None = _ONLY_WHEN_SET
    """Set when the round trained from a model changed after the previous commit."""
    privacy: PrivacyGuarantee | None = _ONLY_WHEN_SET
    """Set when releases were noised: what the ``epsilon`` figures hold against."""
    round_seed: int
    frame_drift: float | None = Field(
        None, description="Gauge diagnostic of the round (None: no gauge adapter)."
    )
    header_digest: str = Field(
        description="Digest of the manifest header (run id, config, root seed, θ_0)."
    )
    entries_digest: str = Field(
        description="Digest of this round's manifest entries: every attempt, the closing "
        "one included (reasons, late, rejected, refused, secure_sum, diagnostics)."
    )
    registry_digest: str | None = Field(
        description="Store digest of the participant registry the round used (None: none)."
    )
    endorsements: dict[str, str] | None = _ONLY_WHEN_SET
    """Participant -> its identity key's signature of the *previous* record's hash
    (``previous_record_hash``), carried in its Commitment or Update of this round and
    checked against its registered key when admitted (:mod:`lensemble_flwr.identity.
    endorsement`). Hashed with the record, so the endorsements are chained too."""
    previous_record_hash: str
    record_hash: str = ""

    @property
    def unbound(self) -> tuple[str, ...]:
        """The contributors whose updates were bound to no dataset commitment."""
        return tuple(p for p in self.contributors if self.dataset_roots.get(p) is None)

    def expected_hash(self) -> str:
        """The hash this record must carry: over every field but ``record_hash``."""
        return digest_record("ledger-record", self.model_dump(mode="json", exclude={"record_hash"}))

    def sealed(self) -> ContributionRecord:
        """A copy whose ``record_hash`` is filled in."""
        return self.model_copy(update={"record_hash": self.expected_hash()})


class RoundEntry(_Frozen):
    """One attempt of one round, as the manifest records it."""

    round: int = Field(ge=1)  # Flower's round number, as the ledger's
    attempt: int
    state: TerminalState
    reason: str | None = None
    round_seed: int
    prior_global_hash: str
    contributors: tuple[str, ...] = ()
    count: int = 0
    total_weight: int = 0
    update_digests: dict[str, str] = {}
    aggregate_digest: str | None = None
    new_global_hash: str | None = None
    invited: tuple[str, ...] = ()  # who the attempt asked (its sample, when sampled)
    late: tuple[str, ...] = ()
    rejected: int = 0
    refused: dict[str, str] = {}
    secure_sum: bool = False  # the outer step consumed a revealed masked sum
    diagnostics: dict[str, float] = {}
    external_step: ExternalStep | None = _ONLY_WHEN_SET  # the attempt's base was changed
    epsilon: dict[str, float] | None = _ONLY_WHEN_SET
    """Participant -> the cumulative epsilon its update admitted in this attempt claimed
    (set when an admitted update claimed one; aborted attempts too): what the coordinator
    saw spent beyond the ledger's records, which a resumed coordinator reads back
    (:mod:`lensemble_flwr.coordinator.spent`)."""


ENDORSED_BY_NEXT_ROUND = "next-round"
"""Endorsement policy: a record is endorsed by its contributors' Commitments and Updates
of the round after it (carried in the next record); the newest record is not yet."""
ENDORSED_ON_WRITE = "on-write"
"""Endorsement policy of a run whose writer is a participant (the shared folder): every
record, the newest included, carries at least its writer's endorsement as soon as it is
written, and the others' as they read it."""
EndorsementPolicy = Literal["next-round", "on-write"]


class _Header(_Frozen):
    run_id: str
    config: dict[str, Any]
    root_seed: int
    initial_params_hash: str
    initial_checkpoint: str
    endorsement: EndorsementPolicy | None = _ONLY_WHEN_SET


def header_digest(manifest: RunManifest) -> str:
    """What a ledger record commits to of the manifest header."""
    return digest_record("manifest-header", manifest.model_dump(mode="json", exclude={"rounds"}))


def entries_digest(entries: Iterable[RoundEntry]) -> str:
    """What a ledger record commits to of its round's manifest entries (by attempt)."""
    ordered = sorted(entries, key=lambda e: e.attempt)
    return digest_record("manifest-entries", [e.model_dump(mode="json") for e in ordered])


class RunManifest(_Frozen):
    """The configuration, seeds and per-round inputs of a run."""

    run_id: str
    config: dict[str, Any]
    root_seed: int
    initial_params_hash: str
    initial_checkpoint: str
    endorsement: EndorsementPolicy | None = _ONLY_WHEN_SET
    """How the run's records are endorsed (None: a run written before endorsements,
    whose history rests on its writer alone)."""
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

    def since(self, round: int) -> RunManifest:
        """This manifest with only the entries of rounds ``round`` and later (what a
        coordinator keeps in memory: the rest stays in the store, see :meth:`entry`)."""
        return self.model_copy(update={"rounds": tuple(e for e in self.rounds if e.round >= round)})

    @staticmethod
    def entry(store: Store, round: int, attempt: int) -> RoundEntry | None:
        """The stored entry of ``attempt`` of ``round``; None when none is recorded.

        Raises:
            StoreError: the entry cannot be read; UnreadableDocument: it does not parse.
        """
        name = manifest_entry_name(round, attempt)
        if not store.bound(name):
            return None
        return _named_entry(store, name)

    @staticmethod
    def _store_entry(store: Store, entry: RoundEntry) -> None:
        name = manifest_entry_name(entry.round, entry.attempt)
        if not store.claim(name, store.put(canonical_json(entry.model_dump(mode="json")))):
            raise LedgerError(f"round {entry.round} attempt {entry.attempt} is already recorded")

    @classmethod
    def from_header(cls, data: bytes) -> RunManifest:
        """The manifest a stored header describes, before any round entry.

        Raises:
            UnreadableDocument: ``data`` is not a manifest header.
        """
        return cls(**dict(parse_document(_Header, data, "manifest header")))

    @classmethod
    def load(cls, store: Store) -> RunManifest:
        """The run's manifest as stored. Raises StoreError or LedgerError."""
        header = cls.from_header(store.get(store.resolve(MANIFEST_HEADER)))
        entries = tuple(_named_entry(store, name) for name in store.bound(MANIFEST_ROUNDS))
        return header.model_copy(update={"rounds": entries})


def _named_entry(store: Store, name: str) -> RoundEntry:
    """The manifest entry bound to ``name``, which must be the name of its round and
    attempt (an entry stored under another attempt's name would hide that attempt).

    Raises:
        StoreError: it cannot be read; UnreadableDocument: it does not parse;
        LedgerError: it is another attempt's.
    """
    entry = parse_document(RoundEntry, store.get(store.resolve(name)), name)
    if manifest_entry_name(entry.round, entry.attempt) != name:
        raise LedgerError(
            f"{name} holds the entry of round {entry.round} attempt {entry.attempt}, not "
            "its own"
        )
    return entry


class UnreadableDocument(LedgerError):
    """A stored manifest header, manifest entry or ledger record that does not parse."""

    def __init__(self, what: str, detail: str, message: str) -> None:
        super().__init__(message)
        self.what = what
        self.detail = detail  # the first problem, in one line


_Doc = TypeVar("_Doc", bound=BaseModel)


def parse_document(model: type[_Doc], data: bytes, what: str) -> _Doc:
    """Parse one stored JSON document (a header, entry or record) as ``model``.

    Raises:
        UnreadableDocument: not JSON, or not a valid ``model``.
    """
    try:
        return model.model_validate(json.loads(data))
    except ValidationError as exc:  # before ValueError, its base class
        detail = first_error(exc)
        raise UnreadableDocument(what, detail, f"{what} does not parse: {exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UnreadableDocument(
            what, f"document: {exc}", f"{what} does not parse: {exc}"
        ) from None


def first_error(exc: ValidationError) -> str:
    """The first of a pydantic validation's errors, as ``location: message``."""
    err = exc.errors()[0]
    loc = ".".join(map(str, err.get("loc", ()))) or "document"
    return f"{loc}: {err.get('msg', 'invalid')}"


class Ledger:
    """The append-only, hash-chained list of ContributionRecords in a store."""

    def __init__(self, store: Store, head: ContributionRecord | None = None) -> None:
        """The ledger in ``store``; ``head``: its newest record, when the caller already
        checked it (:mod:`.follow`), so that :meth:`head` need not list the ledger."""
        self.store = store
        self._head: ContributionRecord | None = head

    def records(self) -> list[ContributionRecord]:
        """All records in round order (as stored; :func:`.verify.verify` checks them)."""
        return [
            parse_document(ContributionRecord, self.store.get(self.store.resolve(name)), name)
            for name in self.store.bound(LEDGER)
        ]

    def head(self) -> ContributionRecord | None:
        """The newest record, or None before the first CLOSED round."""
        if self._head is not None:
            return self._head  # what this Ledger appended last (appends are claims)
        names = self.store.bound(LEDGER)
        if not names:
            return None
        return parse_document(
            ContributionRecord, self.store.get(self.store.resolve(names[-1])), names[-1]
        )

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
        if not self.store.claim(ledger_name(sealed.round), digest):
            raise LedgerError(f"round {sealed.round} is already recorded")
        self._head = sealed
        return sealed
