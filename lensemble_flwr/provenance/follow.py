"""Following a run's ledger as it grows, checking each record once.

A process that resumes the same run again and again (a shared-folder participant decides
a sitting whenever it arrives last, and rebuilds the coordinator from the store each
time) would read and check the whole ledger and manifest on every resume, so a run of R
rounds would cost O(R²). A :class:`LedgerFollower` remembers, in the process, how far it
has checked: each resume reads only the records and manifest entries written since,
checks them with the same link rules as :func:`~lensemble_flwr.provenance.verify.verify`
(record hash, chain from the previous head, agreement with the round's closing entry,
the manifest header and entries it committed to, its registry), and hands back the head.

What it trusts is what this process checked itself; what it reads is found by name
(``ledger/<round>`` and ``manifest/rounds/<round>-<attempt>`` for the next rounds), never
by listing, so the cost of a resume does not grow with the rounds already behind it. A
record stored out of order (a round beyond the next one) is not followed: the next
commit, which claims the next round's name, or a full ``verify`` finds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    MANIFEST_HEADER,
    ContributionRecord,
    ExternalStep,
    RoundEntry,
    RunManifest,
    header_digest,
    ledger_name,
    parse_document,
)
from lensemble_flwr.provenance.verify import (
    LinkBreak,
    agreement_breaks,
    evidence_breaks,
    record_breaks,
    registry_breaks,
    resume_breaks,
)


@dataclasses.dataclass
class LedgerFollower:
    """What one process has checked of the run in ``store``: the manifest header, the
    ledger up to :attr:`head`, and the registries those records named."""

    store: Store
    header: RunManifest | None = None
    head: ContributionRecord | None = None
    last_step: ExternalStep | None = None  # the newest checked record's step that has one
    _known: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    _read: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def through(self) -> int:
        """The last round checked (0: none yet)."""
        return self.head.round if self.head is not None else 0

    def manifest_header(self) -> RunManifest:
        """The run's manifest header (read once), with no round entry."""
        if self.header is None:
            self.header = RunManifest.from_header(
                self.store.get(self.store.resolve(MANIFEST_HEADER))
            )
        return self.header

    def entries(self, round: int) -> tuple[RoundEntry, ...]:
        """The stored manifest entries of ``round``, by attempt (attempts are numbered from
        1 without gaps: an interrupted one is recorded as aborted)."""
        found = []
        attempt = 1
        while (entry := RunManifest.entry(self.store, round, attempt)) is not None:
            found.append(entry)
            attempt += 1
        return tuple(found)

    def unchecked(self) -> list[ContributionRecord]:
        """The records stored after :attr:`head`, in round order, not yet checked."""
        records = []
        round = self.through + 1
        while self.store.bound(name := ledger_name(round)):
            records.append(
                parse_document(ContributionRecord, self.store.get(self.store.resolve(name)), name)
            )
            round += 1
        return records

    def check(self, records: list[ContributionRecord]) -> None:
        """Check ``records`` (the ones :meth:`unchecked` gave) and follow the head to the
        last of them.

        Raises:
            LedgerError: naming the first broken link; nothing is followed.
        """
        header = self.manifest_header()
        header_hash = header_digest(header)
        prev, last_step = self.head, self.last_step
        known, read = dict(self._known), dict(self._read)
        for rec in records:
            entries = self.entries(rec.round)
            closed = [e for e in entries if e.state is RoundState.CLOSED]
            breaks = list(
                record_breaks(
                    rec,
                    previous_record_hash=prev.record_hash if prev else GENESIS,
                    previous_global_hash=(
                        prev.new_global_hash if prev else header.initial_params_hash
                    ),
                )
            )
            if [e.attempt for e in closed] != [rec.attempt]:
                breaks.append(
                    LinkBreak(
                        rec.round,
                        "manifest closed rounds",
                        [rec.attempt],
                        [e.attempt for e in closed],
                        f"round {rec.round}: the manifest's closed attempts "
                        f"{[e.attempt for e in closed]} differ from the ledger's "
                        f"({rec.attempt})",
                    )
                )
            else:
                breaks += agreement_breaks(rec, closed[0])
                breaks += evidence_breaks(
                    rec, header.model_copy(update={"rounds": entries}), header_hash
                )
            breaks += registry_breaks(self.store, [rec], known, read, current=False)
            if breaks:
                raise LedgerError(breaks[0].message)
            prev = rec
            last_step = rec.external_step or last_step
        self.head, self._known, self._read = prev, known, read
        self.last_step = last_step

    def check_registry(self) -> None:
        """Check the current registry against what the records checked so far bound (an
        identity key or dataset root never changes once registered).

        Raises:
            LedgerError: naming the participant.
        """
        for broken in registry_breaks(self.store, [], dict(self._known), self._read):
            raise LedgerError(broken.message)

    def check_resumable(self, current: tuple[RoundEntry, ...]) -> None:
        """Check what lies past the head: ``current`` (the stored entries of the round
        after it, attempts 1, 2, … up to the first missing one), that no attempt follows
        right after that gap and the next round has none, and the kept external step
        (:func:`~lensemble_flwr.provenance.verify.resume_breaks`). Entries are found by
        name, so a longer gap is found only by a full ``verify``.

        Raises:
            LedgerError: naming the artifact.
        """
        t = self.through + 1
        probes = [  # read by name: an attempt past a gap of one, and the next round's first
            RunManifest.entry(self.store, t, len(current) + 2),
            RunManifest.entry(self.store, t + 1, 1),
        ]
        breaks = resume_breaks(
            self.store,
            (*current, *(e for e in probes if e is not None)),
            head=self.head,
            initial_params_hash=self.manifest_header().initial_params_hash,
            last_step=self.last_step,
        )
        for broken in breaks:
            raise LedgerError(broken.message)
