"""Audit a run directory: which link of the run's evidence is broken, and how.

:func:`lensemble_flwr.provenance.verify.verify` is the runtime's fail-closed check: it
walks the rules of :mod:`lensemble_flwr.provenance.verify` and raises on the first broken
link. :func:`audit_run` walks the same rules, reading every blob once, and adds what an
auditor needs on top:

* the cross-checks ``verify`` does not make: the attempt rules
  (:func:`~lensemble_flwr.provenance.verify.attempt_breaks`: every attempt, aborted ones
  too, starts from the global state the round before left, and an aborted one produced
  none; attempts are numbered 1, 2, … with at most one closed and none after it); rounds
  follow each other without gaps from round 1; a name (``ledger/00000003``) holds the
  round it names;
* a :class:`Finding` per broken link that names the round, the field, and the expected
  and found values, in the order a reader walks the run (round by round), so the first
  finding is the first broken link; a missing record does not hide the rounds after it;
* the checkpoints a retention policy pruned (:mod:`.retention`): reported by round in
  :attr:`AuditReport.pruned`, not findings — the ledger still holds their hashes — while
  a kept checkpoint that is wrong, one that is missing without a pruning marker, and a
  pruned newest checkpoint (resuming needs it) are findings;
* optionally, the ledger head an auditor got from elsewhere (every participant hears the
  head's ``record_hash`` in the round's ``RoundClose``): without it, the newest record
  can be rewritten and resealed without breaking any link in the directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import LedgerError, StoreError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    EXTERNAL_STEP,
    GENESIS,
    LEDGER,
    MANIFEST_HEADER,
    MANIFEST_ROUNDS,
    ContributionRecord,
    RoundEntry,
    RunManifest,
    UnreadableDocument,
    header_digest,
    is_pruned,
    ledger_name,
    manifest_entry_name,
    parse_document,
)
from lensemble_flwr.provenance.verify import (
    LinkBreak,
    agreement_breaks,
    attempt_breaks,
    checkpoint_breaks,
    closed_attempt,
    evidence_breaks,
    fetch_blob,
    kept_step_breaks,
    newest_checkpoint_breaks,
    record_breaks,
    record_checkpoint_breaks,
    registry_breaks,
)

_Doc = TypeVar("_Doc")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One broken link of a run's evidence.

    Attributes:
        where: what holds the link: ``"round 3"``, ``"manifest header"``, a store name
            such as ``"ledger/00000003"``, ``"ledger head"``.
        field: the field that disagrees, prefixed by its source (``"ledger.count"``,
            ``"manifest.aggregate_digest"``, ``"checkpoint.params_hash"``).
        expected: what the rest of the evidence says the field must hold.
        found: what it holds.
        round: the round concerned, when there is one.
    """

    where: str
    field: str
    expected: str | None = None
    found: str | None = None
    round: int | None = None

    def __str__(self) -> str:
        text = f"{self.where}: {self.field}"
        if self.expected is not None or self.found is not None:
            text += f": expected {self.expected}, found {self.found}"
        return text

    @classmethod
    def of(cls, where: str, broken: LinkBreak) -> Finding:
        """The finding for a link that a rule of :mod:`.verify` found broken."""
        return cls(where, broken.field, _show(broken.expected), _show(broken.found), broken.round)


class AuditFailure(LedgerError):
    """A run directory whose evidence does not hold together; carries the first finding."""

    def __init__(self, finding: Finding, more: int = 0) -> None:
        tail = f" (and {more} more finding{'s' if more != 1 else ''})" if more else ""
        super().__init__(f"{finding}{tail}")
        self.finding = finding


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What :func:`audit_run` established about a run directory."""

    run_dir: Path
    run_id: str | None
    rounds_closed: int
    attempts_aborted: int
    records: int
    checkpoints: int
    head_record_hash: str | None
    final_global_hash: str | None
    findings: tuple[Finding, ...]
    pruned: tuple[int, ...] = ()
    """The rounds whose checkpoint (θ_round; 0 is θ_0) the retention policy pruned, in
    order; ``checkpoints`` counts the ones read and verified."""

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def first(self) -> Finding | None:
        """The first broken link, in walk order (None when the run holds together)."""
        return self.findings[0] if self.findings else None

    def raise_on_failure(self) -> None:
        """Raise :class:`AuditFailure` naming the first finding, if there is one."""
        if self.findings:
            raise AuditFailure(self.findings[0], len(self.findings) - 1)

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON-able values, plus ``ok`` (what ``verify --json`` prints)."""
        out = dataclasses.asdict(self)
        out["run_dir"] = str(self.run_dir)
        out["ok"] = self.ok
        return out


class NotARunDirectory(StoreError):
    """A path that does not hold a run (no manifest header): nothing to audit."""


def open_run(run_dir: str | os.PathLike[str]) -> Store:
    """The store of an existing run directory, without creating anything in a folder that
    is not one.

    Raises:
        NotARunDirectory: ``run_dir`` does not exist or holds no run manifest.
    """
    root = Path(run_dir)
    if not (root / "names" / MANIFEST_HEADER).is_file() or not (root / "blobs").is_dir():
        raise NotARunDirectory(f"{root} is not a run directory (no {MANIFEST_HEADER} in names/)")
    return Store(root, create=False)  # an audit writes nothing, not even tmp/


def audit_run(
    run_dir: str | os.PathLike[str],
    *,
    expected_head: str | None = None,
) -> AuditReport:
    """Check every link of a run directory's evidence; see the module docstring.

    Args:
        run_dir: the run directory (the coordinator's store).
        expected_head: the ``record_hash`` the newest ledger record must carry (from a
            participant's ``RoundClose`` or any other copy kept outside the directory).

    Returns:
        The report; ``report.findings`` is empty when everything holds.

    Raises:
        NotARunDirectory: ``run_dir`` is not a run directory at all.
    """
    store = open_run(run_dir)
    walk = _Walk(store)
    walk.run(expected_head)
    findings = walk.findings
    return AuditReport(
        run_dir=Path(run_dir),
        run_id=walk.header.run_id if walk.header else None,
        rounds_closed=walk.rounds_closed,
        attempts_aborted=walk.attempts_aborted,
        records=len(walk.records),
        checkpoints=walk.checkpoints,
        head_record_hash=walk.records[-1].record_hash if walk.records else None,
        final_global_hash=walk.global_hash,
        findings=tuple(findings),
        pruned=tuple(sorted(walk.pruned)),
    )


def _show(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(value.items())) + "}"
    return str(value)


class _Walk:
    """One pass over a run directory, round by round, collecting findings in order."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.findings: list[Finding] = []
        self.header: RunManifest | None = None
        self.records: list[ContributionRecord] = []
        self.rounds_closed = 0
        self.attempts_aborted = 0
        self.checkpoints = 0
        self.pruned: set[int] = set()
        self.global_hash: str | None = None
        self._entries_of: dict[int, list[RoundEntry]] = {}

    def _breaks(self, where: str, breaks: Iterable[LinkBreak]) -> None:
        self.findings += [Finding.of(where, b) for b in breaks]

    def _load(self, name: str, parse: Callable[[bytes], _Doc]) -> _Doc | None:
        """The document bound to ``name``, or None after a finding."""
        try:
            digest = self.store.resolve(name)
        except StoreError as exc:
            self.findings.append(Finding(name, "name", "a bound name", str(exc)))
            return None
        data = fetch_blob(self.store, digest, field="blob", round=None, message="")
        if isinstance(data, LinkBreak):
            self._breaks(name, [data])
            return None
        try:
            return parse(data)
        except UnreadableDocument as exc:
            self.findings.append(Finding(name, "contents", found=exc.detail))
            return None

    def run(self, expected_head: str | None) -> None:
        self.header = self._load(MANIFEST_HEADER, RunManifest.from_header)
        if self.header is None:
            return
        self.global_hash = self.header.initial_params_hash
        self._check_checkpoint(
            "initial checkpoint",
            self.header.initial_checkpoint,
            params_hash=self.header.initial_params_hash,
            round=None,
        )
        entries = self._entries()
        self.records = self._records()
        # the checkpoint each round committed (θ_0's as round 0): an external step's
        # change norm is recomputed against the one before it
        self._checkpoint_of = {
            0: self.header.initial_checkpoint,
            **{r.round: r.checkpoint for r in self.records},
        }
        by_round: dict[int, list[RoundEntry]] = {}
        for entry in entries:
            by_round.setdefault(entry.round, []).append(entry)
        self._entries_of = by_round
        records = {r.round: r for r in self.records}
        rounds = sorted(set(by_round) | set(records))
        prev_record: str | None = GENESIS
        for i, t in enumerate(rounds):
            where = f"round {t}"
            expected = rounds[i - 1] + 1 if i else 1  # Flower's numbering: from round 1
            if t != expected:
                self.findings.append(Finding(where, "round sequence", str(expected), str(t), t))
            attempts = sorted(by_round.get(t, []), key=lambda e: e.attempt)
            closed = self._check_attempts(t, attempts, last_round=i == len(rounds) - 1)
            record = records.get(t)
            if record is None:
                if closed is not None:
                    self.findings.append(
                        Finding(
                            where,
                            "ledger record",
                            f"a record for closed attempt {closed.attempt}",
                            "none",
                            t,
                        )
                    )
                    self.global_hash = closed.new_global_hash
                prev_record = None  # the next link cannot be checked against a missing one
                continue
            if closed is None:
                self.findings.append(
                    Finding(
                        where,
                        "manifest closed attempt",
                        f"a closed attempt for ledger record {record.record_hash}",
                        "none" if not attempts else "only aborted attempts",
                        t,
                    )
                )
            self._check_record(record, prev_record, closed)
            prev_record = record.record_hash
            self.global_hash = record.new_global_hash
        if self.records:
            newest = f"round {self.records[-1].round}"
            self._breaks(newest, newest_checkpoint_breaks(self.store, self.records))
        self._breaks("participant registry", registry_breaks(self.store, self.records))
        head = self.records[-1] if self.records else None
        steps = [r.external_step for r in self.records if r.external_step is not None]
        pending = by_round.get(head.round + 1 if head else 1, [])
        self._breaks(
            EXTERNAL_STEP,
            kept_step_breaks(
                self.store, head=head, last_step=steps[-1] if steps else None, pending=pending
            ),
        )
        if expected_head is not None:
            head = self.records[-1].record_hash if self.records else None
            if head != expected_head:
                self.findings.append(Finding("ledger head", "record_hash", expected_head, head))

    def _entries(self) -> list[RoundEntry]:
        entries = []
        for name in self.store.bound(MANIFEST_ROUNDS):
            entry = self._load(name, lambda data, n=name: parse_document(RoundEntry, data, n))
            if entry is None:
                continue
            named = manifest_entry_name(entry.round, entry.attempt)
            if named != name:
                self.findings.append(Finding(name, "round and attempt", name, named, entry.round))
                continue
            entries.append(entry)
        return entries

    def _records(self) -> list[ContributionRecord]:
        records = []
        for name in self.store.bound(LEDGER):
            record = self._load(
                name, lambda data, n=name: parse_document(ContributionRecord, data, n)
            )
            if record is None:
                continue
            named = ledger_name(record.round)
            if named != name:
                self.findings.append(Finding(name, "round", name, named, record.round))
                continue
            records.append(record)
        return records

    def _check_attempts(
        self, t: int, attempts: list[RoundEntry], *, last_round: bool
    ) -> RoundEntry | None:
        """Check one round's attempts; return its closed attempt (None if it has none)."""
        for broken in attempt_breaks(
            t, attempts, committed_hash=self.global_hash, last_round=last_round
        ):
            attempt = "" if broken.attempt is None else f" attempt {broken.attempt}"
            where = f"round {t}{attempt}"
            # the rule's values are already what a finding shows (a missing hash: None)
            self.findings.append(Finding(where, broken.field, broken.expected, broken.found, t))
        closed = sum(entry.state is RoundState.CLOSED for entry in attempts)
        self.rounds_closed += closed
        self.attempts_aborted += len(attempts) - closed
        return closed_attempt(attempts)

    def _check_record(
        self, rec: ContributionRecord, prev_record: str | None, closed: RoundEntry | None
    ) -> None:
        where = f"round {rec.round}"
        self._breaks(
            where,
            record_breaks(
                rec,
                previous_record_hash=prev_record,
                previous_global_hash=self.global_hash,
                checkpoint=self._record_checkpoint_breaks,
            ),
        )
        if closed is not None:
            self._breaks(where, agreement_breaks(rec, closed))
        if self.header is not None:
            entries = self.header.model_copy(
                update={"rounds": tuple(self._entries_of.get(rec.round, []))}
            )
            self._breaks(where, evidence_breaks(rec, entries, header_digest(self.header)))

    def _record_checkpoint_breaks(self, rec: ContributionRecord) -> Iterable[LinkBreak]:
        self._count(rec.checkpoint, rec.round)
        if rec.external_step is not None:
            self._count(rec.external_step.checkpoint, rec.round - 1)
        return record_checkpoint_breaks(self.store, rec, self._checkpoint_of.get(rec.round - 1))

    def _checkpoint_breaks(
        self, digest: str, *, params_hash: str, round: int | None
    ) -> Iterable[LinkBreak]:
        self._count(digest, round or 0)
        return checkpoint_breaks(self.store, digest, params_hash=params_hash, round=round)

    def _count(self, digest: str, round: int) -> None:
        """Count a checkpoint read, or note the round of one that was pruned."""
        if is_pruned(self.store, digest):
            self.pruned.add(round)
        else:
            self.checkpoints += 1

    def _check_checkpoint(
        self, where: str, digest: str, *, params_hash: str, round: int | None
    ) -> None:
        self._breaks(where, self._checkpoint_breaks(digest, params_hash=params_hash, round=round))


__all__ = [
    "AuditFailure",
    "AuditReport",
    "Finding",
    "NotARunDirectory",
    "audit_run",
    "open_run",
]
