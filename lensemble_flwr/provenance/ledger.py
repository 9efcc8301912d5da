"""The contribution ledger, the run manifest, and the check that a run directory is intact.

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
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json, digest_record
from lensemble_flwr.errors import CheckpointIntegrityError, LedgerError, StoreError
from lensemble_flwr.norms import change_norm
from lensemble_flwr.privacy.guarantee import PrivacyGuarantee
from lensemble_flwr.protocol.round import RoundState, TerminalState

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


CHANGE_NORM_REL_TOL = 1e-9
"""How far a recorded ``change_norm`` may be from the one ``verify`` recomputes: the
rounding of a sum taken in another order. Norms are now the same bits on every machine
(:mod:`lensemble_flwr.norms`), but a run recorded by an earlier version summed with BLAS,
whose last bits depended on the CPU and its thread count; a false claim is off by far
more than this."""

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


class _Header(_Frozen):
    run_id: str
    config: dict[str, Any]
    root_seed: int
    initial_params_hash: str
    initial_checkpoint: str


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
        return parse_document(RoundEntry, store.get(store.resolve(name)), name)

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
        entries = tuple(
            parse_document(RoundEntry, store.get(store.resolve(name)), name)
            for name in store.bound(MANIFEST_ROUNDS)
        )
        return header.model_copy(update={"rounds": entries})


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
        """All records in round order (as stored; :func:`verify` checks them)."""
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


def verify(store: Store) -> list[ContributionRecord]:
    """Check a run's ledger chain, checkpoints and manifest against each other.

    A checkpoint the retention policy pruned (:func:`is_pruned`) is not read; every kept
    one is. The newest record's checkpoint must be kept.

    Returns:
        The verified records, in round order.

    Raises:
        LedgerError: naming the first broken link (a record hash, a chain link, a
            checkpoint that does not match its record or is missing without having been
            pruned, a pruned newest checkpoint, a manifest that disagrees).
    """
    manifest = RunManifest.load(store)
    _raise_first(
        checkpoint_breaks(
            store, manifest.initial_checkpoint, params_hash=manifest.initial_params_hash
        )
    )
    records = Ledger(store).records()
    committed = {0: manifest.initial_checkpoint, **{r.round: r.checkpoint for r in records}}
    _raise_first(
        link_breaks(
            records,
            manifest,
            lambda rec: record_checkpoint_breaks(store, rec, committed.get(rec.round - 1)),
        )
    )
    if records and is_pruned(store, records[-1].checkpoint):
        raise LedgerError(
            f"round {records[-1].round}: the newest checkpoint was pruned (resuming needs it)"
        )
    verify_registry(store, records)
    return records


def verify_chain(records: list[ContributionRecord], manifest: RunManifest) -> None:
    """The checks of :func:`verify` that read no checkpoint: every record's hash, the
    chain of record and global hashes from the manifest's θ_0, and the agreement of the
    ledger with the manifest's closed rounds.

    Raises:
        LedgerError: naming the first broken link.
    """
    _raise_first(link_breaks(records, manifest))


def verify_registry(store: Store, records: list[ContributionRecord]) -> None:
    """The registry checks of :func:`verify` (see :func:`registry_breaks`): a restarted
    coordinator runs them before it trusts its stored registry, so a swapped identity key
    is refused instead of admitting an impostor.

    Raises:
        LedgerError: naming the first broken link.
    """
    _raise_first(registry_breaks(store, records))


# -- the link rules: one definition, walked by verify() and by the run audit --------------------
@dataclasses.dataclass(frozen=True)
class LinkBreak:
    """One broken link of a run's evidence.

    Attributes:
        round: the ledger round concerned (None for θ_0 and for run-wide links).
        field: what disagrees, prefixed by its source (``"ledger.count"``,
            ``"manifest.aggregate_digest"``, ``"checkpoint.params_hash"``).
        expected: what the rest of the evidence says ``field`` must hold.
        found: what it holds.
        message: the sentence :func:`verify` raises for it.
    """

    round: int | None
    field: str
    expected: Any
    found: Any
    message: str


def _raise_first(breaks: Iterator[LinkBreak]) -> None:
    for broken in breaks:
        raise LedgerError(broken.message)


def fetch_blob(
    store: Store, digest: str, *, field: str, round: int | None, message: str
) -> bytes | LinkBreak:
    """The blob's bytes (re-hashed by the store), or the break saying it is missing or
    does not hash to its address; ``message`` prefixes the store's own error."""
    try:
        return store.get(digest)
    except CheckpointIntegrityError as exc:
        return LinkBreak(
            round, f"{field} sha256", digest, f"other bytes ({exc})", f"{message}{exc}"
        )
    except StoreError as exc:
        return LinkBreak(round, field, digest, f"missing ({exc})", f"{message}{exc}")


def checkpoint_breaks(
    store: Store, digest: str, *, params_hash: str, round: int | None = None
) -> Iterator[LinkBreak]:
    """The checkpoint blob ``digest`` must decode and hold ``params_hash``.

    Args:
        round: the ledger round whose new global state the checkpoint holds (θ_round:
            the checkpoint's own round is then ``round`` too); None for θ_0's.
    """
    label = "initial checkpoint" if round is None else f"round {round}: checkpoint"
    if is_pruned(store, digest):
        return  # pruned by the retention policy: the ledger still holds its hashes
    data = fetch_blob(store, digest, field="checkpoint", round=round, message=f"{label}: ")
    if isinstance(data, LinkBreak):
        yield data
        return
    try:
        ckpt = decode_checkpoint(data)
    except CheckpointIntegrityError as exc:
        yield LinkBreak(round, "checkpoint", "a lensemble checkpoint", str(exc), f"{label}: {exc}")
        return
    if round is None:
        wrong = "initial checkpoint does not match the manifest's initial params hash"
    else:
        wrong = f"round {round}: checkpoint does not hold the recorded new global state"
    if ckpt.params_hash != params_hash:
        yield LinkBreak(round, "checkpoint.params_hash", params_hash, ckpt.params_hash, wrong)
    if round is not None and ckpt.round != round:
        yield LinkBreak(round, "checkpoint.round", round, ckpt.round, wrong)


def record_checkpoint_breaks(
    store: Store, rec: ContributionRecord, committed_checkpoint: str | None = None
) -> Iterator[LinkBreak]:
    """The checkpoints a ledger record names: the one of the state it produced, and the
    adopted model's when the round trained from a model changed by an external step —
    whose recorded change norm is recomputed against ``committed_checkpoint`` (the
    previous round's, or θ_0's; None: not recomputed)."""
    yield from checkpoint_breaks(
        store, rec.checkpoint, params_hash=rec.new_global_hash, round=rec.round
    )
    step = rec.external_step
    if step is None:
        return
    breaks = list(
        checkpoint_breaks(
            store, step.checkpoint, params_hash=step.adopted_hash, round=rec.round - 1
        )
    )
    yield from breaks
    if breaks or committed_checkpoint is None:
        return
    if is_pruned(store, step.checkpoint) or is_pruned(store, committed_checkpoint):
        return  # one of the two models was pruned: the change norm cannot be recomputed
    try:
        adopted = decode_checkpoint(store.get(step.checkpoint)).params
        committed = decode_checkpoint(store.get(committed_checkpoint)).params
    except (CheckpointIntegrityError, StoreError) as exc:  # named by the chain's own checks
        yield LinkBreak(rec.round, "external_step.checkpoint", "readable", str(exc), str(exc))
        return
    try:
        norm = change_norm(committed, adopted) if set(committed) == set(adopted) else None
    except ValueError:  # an array of another size under the same name: not the model
        norm = None
    if norm is None or not math.isclose(norm, step.change_norm, rel_tol=CHANGE_NORM_REL_TOL):
        yield LinkBreak(
            rec.round,
            "ledger.external_step.change_norm",
            norm,
            step.change_norm,
            f"round {rec.round}: its external step's change norm is not the distance "
            "between the committed and the adopted model",
        )


def record_breaks(
    rec: ContributionRecord,
    *,
    previous_record_hash: str | None,
    previous_global_hash: str | None,
    checkpoint: Callable[[ContributionRecord], Iterator[LinkBreak]] | None = None,
) -> Iterator[LinkBreak]:
    """One ledger record: its own hash, its links to the record and the global state before
    it (``previous_record_hash`` None: not checked), its checkpoint (when ``checkpoint``
    is given), and a contributing set that agrees with C_t, the update digests and the
    dataset roots (``contributors`` is the sorted list of who sent an update)."""
    t, where = rec.round, f"round {rec.round}"
    if rec.record_hash != rec.expected_hash():
        yield LinkBreak(
            t,
            "ledger.record_hash",
            rec.expected_hash(),
            rec.record_hash,
            f"{where}: record hash does not match its contents",
        )
    if previous_record_hash is not None and rec.previous_record_hash != previous_record_hash:
        yield LinkBreak(
            t,
            "ledger.previous_record_hash",
            previous_record_hash,
            rec.previous_record_hash,
            f"{where}: chain broken (previous record hash differs)",
        )
    step = rec.external_step
    if step is not None and step.committed_hash != previous_global_hash:
        yield LinkBreak(
            t,
            "ledger.external_step.committed_hash",
            previous_global_hash,
            step.committed_hash,
            f"{where}: its external step does not start from the prior round's new hash",
        )
    trained_from = step.adopted_hash if step is not None else previous_global_hash
    if rec.previous_global_hash != trained_from:
        yield LinkBreak(
            t,
            "ledger.previous_global_hash",
            trained_from,
            rec.previous_global_hash,
            f"{where}: previous global hash is not the prior round's new hash"
            + (" changed by its external step" if step is not None else ""),
        )
    if checkpoint is not None:
        yield from checkpoint(rec)
    disagree = f"{where}: contributing set and C_t disagree"
    for field, expected, found in [
        ("ledger.count", len(rec.contributors), rec.count),
        ("ledger.update_digests senders", rec.contributors, tuple(sorted(rec.update_digests))),
        ("ledger.dataset_roots senders", rec.contributors, tuple(sorted(rec.dataset_roots))),
    ]:
        if expected != found:
            yield LinkBreak(t, field, expected, found, disagree)


def agreement_breaks(rec: ContributionRecord, entry: RoundEntry) -> Iterator[LinkBreak]:
    """A closed attempt's manifest entry must say what its ledger record says."""
    pairs: list[tuple[str, Any, Any]] = []
    if rec.frame_drift is not None and FRAME_DRIFT in entry.diagnostics:
        pairs.append(
            ("manifest.diagnostics.frame_drift", rec.frame_drift, entry.diagnostics[FRAME_DRIFT])
        )
    pairs += [
        ("manifest.attempt", rec.attempt, entry.attempt),
        ("manifest.prior_global_hash", rec.previous_global_hash, entry.prior_global_hash),
        ("manifest.round_seed", rec.round_seed, entry.round_seed),
        ("manifest.contributors", rec.contributors, entry.contributors),
        ("manifest.count", rec.count, entry.count),
        ("manifest.total_weight", rec.total_weight, entry.total_weight),
        ("manifest.update_digests", rec.update_digests, entry.update_digests),
        ("manifest.aggregate_digest", rec.aggregate_digest, entry.aggregate_digest),
        ("manifest.new_global_hash", rec.new_global_hash, entry.new_global_hash),
        ("manifest.external_step", rec.external_step, entry.external_step),
    ]
    message = f"round {rec.round}: manifest and ledger disagree"
    for field, expected, found in pairs:
        if expected != found:
            yield LinkBreak(rec.round, field, expected, found, message)


def link_breaks(
    records: list[ContributionRecord],
    manifest: RunManifest,
    checkpoint: Callable[[ContributionRecord], Iterator[LinkBreak]] | None = None,
) -> Iterator[LinkBreak]:
    """Every record's links in round order from the manifest's θ_0, then the manifest's
    closed rounds against the ledger's, lazily (so :func:`verify` stops at the first)."""
    prev_record, prev_global = GENESIS, manifest.initial_params_hash
    for rec in records:
        yield from record_breaks(
            rec,
            previous_record_hash=prev_record,
            previous_global_hash=prev_global,
            checkpoint=checkpoint,
        )
        prev_record, prev_global = rec.record_hash, rec.new_global_hash
    closed = {e.round: e for e in manifest.rounds if e.state is RoundState.CLOSED}
    rounds = [r.round for r in records]
    if sorted(closed) != rounds:
        yield LinkBreak(
            None,
            "manifest closed rounds",
            sorted(closed),
            rounds,
            f"manifest closed rounds {sorted(closed)} differ from ledger rounds {rounds}",
        )
        return
    header = header_digest(manifest)
    for rec in records:
        yield from agreement_breaks(rec, closed[rec.round])
        yield from evidence_breaks(rec, manifest, header)


def evidence_breaks(
    rec: ContributionRecord, manifest: RunManifest, header: str | None = None
) -> Iterator[LinkBreak]:
    """What a record commits to of the manifest: the header, and every entry of its round
    up to the closing attempt (so a changed config, run id or seed, a reason, a late,
    rejected or refused list, ``secure_sum`` or a diagnostic is a broken link)."""
    header = header_digest(manifest) if header is None else header
    if rec.header_digest != header:
        yield LinkBreak(
            rec.round,
            "ledger.header_digest",
            header,
            rec.header_digest,
            f"round {rec.round}: the manifest header is not the one the ledger committed to "
            "(run id, config, root seed or θ_0 changed)",
        )
    entries = [e for e in manifest.rounds if e.round == rec.round and e.attempt <= rec.attempt]
    found = entries_digest(entries)
    if rec.entries_digest != found:
        yield LinkBreak(
            rec.round,
            "ledger.entries_digest",
            rec.entries_digest,
            found,
            f"round {rec.round}: its manifest entries are not the ones the ledger committed "
            "to (an attempt's reason, late/rejected/refused, secure_sum or diagnostics "
            "changed, or an attempt was added or removed)",
        )


def _registry_commitments(store: Store, digest: str, what: str) -> Mapping[str, Any] | LinkBreak:
    data = fetch_blob(store, digest, field="registry", round=None, message=f"{what}: ")
    if isinstance(data, LinkBreak):
        return data
    try:
        commitments = json.loads(data)["commitments"]
        if not isinstance(commitments, dict) or not all(
            isinstance(c, dict) for c in commitments.values()
        ):
            raise TypeError("commitments is not a mapping of commitments")
        return commitments
    except (ValueError, KeyError, TypeError) as exc:
        return LinkBreak(None, "registry", "a participant registry", str(exc), f"{what}: {exc}")


def registry_breaks(
    store: Store,
    records: list[ContributionRecord],
    known: dict[str, tuple[Any, Any]] | None = None,
    read: dict[str, Mapping[str, Any] | LinkBreak] | None = None,
    *,
    current: bool = True,
) -> Iterator[LinkBreak]:
    """The registries the records committed to, and the current one.

    Each record's registry must be stored intact and bind every bound contributor to the
    dataset root the record names. A participant's identity key and dataset root never
    change once registered: not from one record's registry to the next, and not in the
    current registry (which may have gained participants since the newest record: a
    later round that has not closed yet).

    ``known`` (participant -> identity key, dataset root) and ``read`` (registry digest ->
    its commitments) carry what earlier records established, for a caller that checks a
    growing ledger a few records at a time (:mod:`.follow`); both are updated.
    ``current=False`` leaves the current registry out.
    """
    known = {} if known is None else known  # pid -> (identity key, dataset root)
    read = {} if read is None else read  # each registry blob read once
    for rec in records:
        if rec.registry_digest is None:
            continue
        if rec.registry_digest not in read:
            read[rec.registry_digest] = _registry_commitments(
                store, rec.registry_digest, f"round {rec.round}: participant registry"
            )
        commitments = read[rec.registry_digest]
        if isinstance(commitments, LinkBreak):
            yield dataclasses.replace(commitments, round=rec.round)
            continue
        for pid, root in rec.dataset_roots.items():
            bound = commitments.get(pid, {}).get("dataset_root")
            if root is not None and bound != root:
                yield LinkBreak(
                    rec.round,
                    "registry.dataset_root",
                    root,
                    bound,
                    f"round {rec.round}: the registry it used binds {pid} to another root",
                )
        yield from _unchanged(known, commitments, f"round {rec.round}: participant registry")
    if not current or not known or not store.bound(REGISTRY):
        return
    try:
        digest = store.resolve(REGISTRY)
    except StoreError as exc:
        yield LinkBreak(None, "registry", "a bound name", str(exc), f"participant registry: {exc}")
        return
    current = read.get(digest) or _registry_commitments(store, digest, "participant registry")
    if isinstance(current, LinkBreak):
        yield current
        return
    yield from _unchanged(known, current, "participant registry")


def _unchanged(
    known: dict[str, tuple[Any, Any]], commitments: Mapping[str, Any], what: str
) -> Iterator[LinkBreak]:
    for pid, commitment in sorted(commitments.items()):
        now = (commitment.get("identity_key"), commitment.get("dataset_root"))
        before = known.setdefault(pid, now)
        if before != now:  # an identity key appearing later counts too: fail closed
            yield LinkBreak(
                None,
                f"registry.{pid}",
                before,
                now,
                f"{what}: {pid}'s identity key or dataset root changed after the ledger "
                "recorded it",
            )
    missing = sorted(set(known) - set(commitments))
    if missing:
        yield LinkBreak(
            None, "registry", sorted(known), sorted(commitments),
            f"{what}: registered participants {missing} are gone",
        )  # fmt: skip
