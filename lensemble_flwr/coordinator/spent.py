"""What each participant had spent of its privacy budget, as far as the coordinator has
seen, and the check that its next release claims more.

A participant's Update carries its cumulative epsilon after the release (``Update.epsilon``,
covered by its signature when it signs). Every committed round's ledger record keeps each
contributor's figure, and every attempt's manifest entry, an aborted one's too, keeps the
figure of each update it admitted (``RoundEntry.epsilon``): a release admitted into an
attempt that later aborted was charged all the same. Charging a budget for a release
always raises its cumulative epsilon, so an Update that claims no more than the largest
figure seen from its participant comes from a budget that lost what it had spent: its
file was deleted, replaced or rolled back (e.g. restored, with the node's state, from a
backup taken after the last committed round but before a release the coordinator saw),
and the participant is spending again what it already released. The coordinator refuses
such an Update (:class:`~lensemble_flwr.errors.PrivacyBudgetRolledBack`: the federation
stops, as for a participant's own refusal of a spent or unreadable budget).

The figures are read from the ledger and the manifest when first needed (so a resumed
coordinator has them) and kept up to date with every record the coordinator commits and
every attempt it ends. Those of an attempt a coordinator crash cut short were never
stored: a resumed coordinator does not know them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from lensemble_flwr.errors import PrivacyBudgetRolledBack
from lensemble_flwr.protocol.messages import Update
from lensemble_flwr.provenance.ledger import ContributionRecord, RoundEntry

_TOLERANCE = 1e-9
"""Relative slack for floating point: a charge raises epsilon by far more than this."""


def no_entries() -> Iterable[RoundEntry]:
    """No manifest entry (figures from the ledger's records only)."""
    return ()


class SpentBudgets:
    """Each participant's largest cumulative epsilon in the run's ledger records and in
    the updates its recorded attempts admitted.

    Args:
        records: the run's ledger records (read once, on first use).
        entries: the run's manifest entries, every attempt (read once, on first use).
    """

    def __init__(
        self,
        records: Callable[[], Iterable[ContributionRecord]],
        entries: Callable[[], Iterable[RoundEntry]] = no_entries,
    ) -> None:
        self._records = records
        self._entries = entries
        self._spent: dict[str, float] | None = None

    def _loaded(self) -> dict[str, float]:
        if self._spent is None:
            spent: dict[str, float] = {}
            for record in self._records():
                _fold(spent, record.epsilon)
            for entry in self._entries():
                _fold(spent, entry.epsilon or {})
            self._spent = spent
        return self._spent

    def before(self, participant_id: str) -> float | None:
        """The participant's largest cumulative epsilon seen so far (None: none)."""
        return self._loaded().get(participant_id)

    def forget(self) -> None:
        """Read the ledger again on next use (a commit whose record was not handed here)."""
        self._spent = None

    def committed(self, record: ContributionRecord) -> None:
        """Take the figures of a record just committed."""
        if self._spent is not None:  # else read with the rest on first use
            _fold(self._spent, record.epsilon)

    def ended(self, entry: RoundEntry) -> None:
        """Take the figures of an attempt just recorded (aborted or closed)."""
        if self._spent is not None and entry.epsilon:  # else read on first use
            _fold(self._spent, entry.epsilon)


def _fold(spent: dict[str, float], figures: Mapping[str, float | None]) -> None:
    for pid, epsilon in figures.items():
        if epsilon is not None and epsilon > spent.get(pid, float("-inf")):
            spent[pid] = float(epsilon)


def check_spent(before: float | None, update: Update) -> None:
    """Refuse ``update`` when it claims no more epsilon than its sender had spent.

    Raises:
        PrivacyBudgetRolledBack: the participant was seen to have spent ``before`` in
            this run (in a committed round, or an update an attempt admitted) and now
            claims no more (or no epsilon at all): its budget file was deleted or rolled
            back.
    """
    if before is None:
        return
    claimed = update.epsilon
    if claimed is None or claimed <= before * (1 + _TOLERANCE):
        shown = "none" if claimed is None else f"{claimed:.4g}"
        raise PrivacyBudgetRolledBack(
            f"{update.participant_id}: budget file rolled back or deleted: epsilon "
            f"{before:.4g} spent before, {shown} claimed now after a further release; "
            "refused (restore the participant's budget file)"
        )
