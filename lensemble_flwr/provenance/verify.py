"""The verification rules of a run's evidence, and :func:`verify`, the fail-closed check.

A *rule* is a generator of :class:`LinkBreak`: one broken link each, naming the round, the
field, the expected and the found value, and the sentence :func:`verify` raises. The rules
are the one definition of what a run's evidence must satisfy, walked three ways:

* :func:`verify` (and :func:`verify_chain`, :func:`verify_registry`): raise
  :class:`~lensemble_flwr.errors.LedgerError` on the first broken link (a resume, a
  participant's join, ``lensemble-flwr verify``'s exit code);
* :func:`lensemble_flwr.provenance.audit.audit_run`: every broken link, as findings,
  with the attempt rules (:func:`attempt_breaks`) on top;
* :class:`lensemble_flwr.provenance.follow.LedgerFollower`: a growing ledger, a few
  records at a time.

The records, the manifest and the chain they are checked against are in
:mod:`lensemble_flwr.provenance.ledger`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import CheckpointIntegrityError, LedgerError, StoreError
from lensemble_flwr.norms import change_norm
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    EXTERNAL_STEP,
    FRAME_DRIFT,
    GENESIS,
    REGISTRY,
    ContributionRecord,
    ExternalStep,
    Ledger,
    RoundEntry,
    RunManifest,
    entries_digest,
    header_digest,
    is_pruned,
    ledger_name,
    load_external_step,
    manifest_entry_name,
)

CHANGE_NORM_REL_TOL = 1e-9
"""How far a recorded ``change_norm`` may be from the one ``verify`` recomputes: the
rounding of a sum taken in another order. Norms are now the same bits on every machine
(:mod:`lensemble_flwr.norms`), but a run recorded by an earlier version summed with BLAS,
whose last bits depended on the CPU and its thread count; a false claim is off by far
more than this."""


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
    _raise_first(newest_checkpoint_breaks(store, records))
    verify_registry(store, records)
    verify_resumable(store, records, manifest)
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


def verify_resumable(
    store: Store, records: list[ContributionRecord], manifest: RunManifest
) -> None:
    """The checks of :func:`verify` on what lies past the newest record (see
    :func:`resume_breaks`): a restarted coordinator runs them before it continues.

    Raises:
        LedgerError: naming the first broken link and the artifact that holds it.
    """
    head = records[-1] if records else None
    last_step = next((r.external_step for r in reversed(records) if r.external_step), None)
    _raise_first(
        resume_breaks(
            store,
            manifest.rounds,
            head=head,
            initial_params_hash=manifest.initial_params_hash,
            last_step=last_step,
        )
    )


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

        attempt: the manifest attempt concerned, for the attempt rules
            (:func:`attempt_breaks`); None otherwise.
    """

    round: int | None
    field: str
    expected: Any
    found: Any
    message: str
    attempt: int | None = None


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
    yield from change_norm_breaks(
        store,
        step,
        committed_checkpoint,
        rec.round,
        field="ledger.external_step.change_norm",
        message=f"round {rec.round}: its external step's change norm is not the distance "
        "between the committed and the adopted model",
    )


def change_norm_breaks(
    store: Store,
    step: ExternalStep,
    committed_checkpoint: str,
    round: int | None,
    *,
    field: str,
    message: str,
) -> Iterator[LinkBreak]:
    """``step``'s recorded change norm must be the distance between the model in
    ``committed_checkpoint`` and the one in its own checkpoint (not recomputed when either
    was pruned)."""
    if is_pruned(store, step.checkpoint) or is_pruned(store, committed_checkpoint):
        return  # one of the two models was pruned: the change norm cannot be recomputed
    try:
        adopted = decode_checkpoint(store.get(step.checkpoint)).params
        committed = decode_checkpoint(store.get(committed_checkpoint)).params
    except (CheckpointIntegrityError, StoreError) as exc:  # named by the chain's own checks
        yield LinkBreak(round, "external_step.checkpoint", "readable", str(exc), str(exc))
        return
    try:
        norm = change_norm(committed, adopted) if set(committed) == set(adopted) else None
    except ValueError:  # an array of another size under the same name: not the model
        norm = None
    if norm is None or not math.isclose(norm, step.change_norm, rel_tol=CHANGE_NORM_REL_TOL):
        yield LinkBreak(round, field, norm, step.change_norm, message)


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
        missing = [ledger_name(t) for t in sorted(set(closed) - set(rounds))]
        yield LinkBreak(
            None,
            "manifest closed rounds",
            sorted(closed),
            rounds,
            f"manifest closed rounds {sorted(closed)} differ from ledger rounds {rounds}"
            + (f" (the ledger records {missing} are missing)" if missing else ""),
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
    if not current or not known:
        return
    if not store.bound(REGISTRY):  # the records bound participants: it cannot be gone
        yield LinkBreak(
            None, "registry", REGISTRY, "missing",
            f"participant registry: {REGISTRY} is missing, yet the ledger's records bound "
            f"participants {sorted(known)} with it (an impostor could register in their "
            "names)",
        )  # fmt: skip
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


def newest_checkpoint_breaks(
    store: Store, records: list[ContributionRecord]
) -> Iterator[LinkBreak]:
    """The newest record's checkpoint must be kept: a retention policy prunes older ones
    only (resuming, and a joining participant, need the newest)."""
    if records and is_pruned(store, records[-1].checkpoint):
        t = records[-1].round
        yield LinkBreak(
            t,
            "checkpoint",
            "kept (newest)",
            "pruned",
            f"round {t}: the newest checkpoint was pruned (resuming needs it)",
        )


def attempt_breaks(
    round: int, attempts: list[RoundEntry], *, committed_hash: str | None, last_round: bool
) -> Iterator[LinkBreak]:
    """A round's manifest attempts, aborted ones included (what the ledger's records do not
    cover): numbered 1, 2, ... in order, at most one closed and none after it, one external
    step for the whole round, each starting from ``committed_hash`` (the global state the
    round before left) or from the external step's adopted model, an aborted one producing
    no global state, and a closed one before the next round (``last_round``: none follows).

    Expected and found values are strings (None where a hash is missing), as an audit
    shows them.
    """
    where = f"round {round}"
    closed: RoundEntry | None = None
    for number, entry in enumerate(attempts, start=1):
        at, a = f"{where} attempt {entry.attempt}", entry.attempt
        if entry.attempt != number:
            yield LinkBreak(
                round, "manifest.attempt", str(number), str(entry.attempt),
                f"{where}: attempt {entry.attempt} is numbered out of order (expected {number})",
            )  # fmt: skip
        if closed is not None:
            yield LinkBreak(
                round, "manifest.state", f"no attempt after closed attempt {closed.attempt}",
                f"attempt {entry.attempt} ({entry.state})",
                f"{where}: attempt {entry.attempt} follows closed attempt {closed.attempt}",
            )  # fmt: skip
        step = entry.external_step
        if step != attempts[0].external_step:  # one model per round: one release
            yield LinkBreak(
                round, "manifest.external_step",
                "the round's one external step (that of its first attempt)",
                step.adopted_hash if step is not None else "none",
                f"{at}: its external step is not the round's", a,
            )  # fmt: skip
        if step is not None and step.committed_hash != committed_hash:
            yield LinkBreak(
                round, "manifest.external_step.committed_hash", committed_hash,
                step.committed_hash,
                f"{at}: its external step does not start from the prior round's new hash", a,
            )  # fmt: skip
        trained_from = step.adopted_hash if step is not None else committed_hash
        if entry.prior_global_hash != trained_from:
            yield LinkBreak(
                round, "manifest.prior_global_hash", trained_from, entry.prior_global_hash,
                f"{at}: prior global hash is not the prior round's new hash", a,
            )  # fmt: skip
        if entry.state is RoundState.CLOSED:
            closed = closed or entry
        elif entry.new_global_hash is not None:
            yield LinkBreak(
                round, "manifest.new_global_hash", "none (the attempt was aborted)",
                entry.new_global_hash, f"{at}: an aborted attempt records a new global hash", a,
            )  # fmt: skip
    if closed is None and attempts and not last_round:
        yield LinkBreak(
            round, "manifest.state", "a closed attempt before the next round",
            "only aborted attempts", f"{where}: no attempt closed, yet a later round ran",
        )  # fmt: skip


def closed_attempt(attempts: list[RoundEntry]) -> RoundEntry | None:
    """The round's closed attempt (the first, should a broken manifest hold several)."""
    return next((e for e in attempts if e.state is RoundState.CLOSED), None)


def resume_breaks(
    store: Store,
    entries: Iterable[RoundEntry],
    *,
    head: ContributionRecord | None,
    initial_params_hash: str,
    last_step: ExternalStep | None,
) -> Iterator[LinkBreak]:
    """What a resume continues from beyond the ledger: the manifest ``entries`` past the
    ``head`` record (:func:`uncommitted_breaks`) and the kept external step
    (:func:`kept_step_breaks`; ``last_step``: the newest record's step that has one)."""
    entries = list(entries)
    after = head.round if head is not None else 0
    committed_hash = head.new_global_hash if head is not None else initial_params_hash
    yield from uncommitted_breaks(entries, after=after, committed_hash=committed_hash)
    pending = [e for e in entries if e.round == after + 1]
    yield from kept_step_breaks(store, head=head, last_step=last_step, pending=pending)


def uncommitted_breaks(
    entries: Iterable[RoundEntry], *, after: int, committed_hash: str
) -> Iterator[LinkBreak]:
    """Manifest entries past the newest record (round ``after``, which left
    ``committed_hash``) belong to the round in flight only, and follow its attempt rules
    (:func:`attempt_breaks`): numbered 1, 2, …, each from the committed model or the
    round's one external step, none producing a global state. A closed one is
    :func:`link_breaks`' (a ledger record is missing)."""
    entries = [e for e in entries if e.round > after]
    beyond = sorted((e.round, e.attempt) for e in entries if e.round > after + 1)
    if beyond:
        name = manifest_entry_name(*beyond[0])
        yield LinkBreak(
            beyond[0][0], "manifest.round", after + 1, beyond[0][0],
            f"{name}: an attempt of round {beyond[0][0]}, yet the ledger ends at round "
            f"{after} (a round runs only once the one before it is in the ledger)",
            beyond[0][1],
        )  # fmt: skip
    attempts = sorted((e for e in entries if e.round == after + 1), key=lambda e: e.attempt)
    for broken in attempt_breaks(
        after + 1, attempts, committed_hash=committed_hash, last_round=True
    ):
        if broken.attempt is None:
            yield broken
            continue
        name = manifest_entry_name(after + 1, broken.attempt)
        yield dataclasses.replace(broken, message=f"{name}: {broken.message}")


def kept_step_breaks(
    store: Store,
    *,
    head: ContributionRecord | None,
    last_step: ExternalStep | None,
    pending: Iterable[RoundEntry] = (),
) -> Iterator[LinkBreak]:
    """The external step kept under ``coordinator/external-step`` must be one the
    evidence binds: the step of the newest record that has one (``last_step``: a round
    already trained from it), or the pending step of the round after ``head`` — which
    starts from ``head``'s model, is the step of every attempt of that round the manifest
    holds (``pending``), and whose checkpoint holds the adopted model at the recorded
    change norm from ``head``'s. A coordinator changes only the model it just committed,
    so a step kept before any round committed is never one of its own. And a round in
    flight whose attempts trained from a step needs that step still kept (else a resume
    would train from the model the step replaced: the un-noised one, under central DP)."""
    pending = list(pending)
    stepped = [(e.attempt, e.external_step) for e in pending if e.external_step is not None]
    try:
        step = load_external_step(store)
    except (LedgerError, StoreError) as exc:
        yield LinkBreak(None, "external_step", "an external step", str(exc), str(exc))
        return
    t = head.round + 1 if head is not None else 1
    if stepped and (step is None or step == last_step):
        attempt, trained_from = stepped[0]  # the round in flight's step is no longer kept
        yield LinkBreak(
            t, "external_step", trained_from.adopted_hash, "missing",
            f"{EXTERNAL_STEP} is missing or replaced, yet round {t} attempt {attempt} "
            f"({manifest_entry_name(t, attempt)}) trained from the model a step adopted",
            attempt,
        )  # fmt: skip
        return
    if step is None or step == last_step:
        return
    if head is None or step.committed_hash != head.new_global_hash:
        yield LinkBreak(
            None, "external_step", "a ledger record's step, or one from the newest model",
            step.adopted_hash,
            f"{EXTERNAL_STEP} is no ledger record's external step and does not start from "
            "the newest committed model: no coordinator kept it (it was written by hand)",
        )  # fmt: skip
        return
    for entry in pending:
        if entry.external_step != step:
            found = entry.external_step.adopted_hash if entry.external_step else "no step"
            yield LinkBreak(
                t, "manifest.external_step", step.adopted_hash, found,
                f"{EXTERNAL_STEP}: round {t} attempt {entry.attempt} "
                f"({manifest_entry_name(t, entry.attempt)}) trained from another model than "
                "the kept external step's (a step is kept before a round's first attempt)",
                entry.attempt,
            )  # fmt: skip
    for broken in checkpoint_breaks(
        store, step.checkpoint, params_hash=step.adopted_hash, round=head.round
    ):
        yield dataclasses.replace(broken, message=f"{EXTERNAL_STEP}: {broken.message}")
    yield from change_norm_breaks(
        store,
        step,
        head.checkpoint,
        t,
        field="external_step.change_norm",
        message=f"{EXTERNAL_STEP}: its change norm is not the distance between the newest "
        "committed model and the adopted one",
    )
