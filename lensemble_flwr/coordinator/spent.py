"""What each participant had spent of its privacy budget, as the run's ledger records it,
and the check that its next release claims more.

A participant's Update carries its cumulative epsilon after the release (``Update.epsilon``,
covered by its signature when it signs), and every committed round's ledger record keeps
each contributor's figure. Charging a budget for a release always raises its cumulative
epsilon, so an Update that claims no more than the participant's last recorded figure comes
from a budget that lost what it had spent: its file was deleted, replaced or rolled back,
and the participant is spending again what it already released. The coordinator refuses
such an Update (:class:`~lensemble_flwr.errors.PrivacyBudgetRolledBack`: the federation
stops, as for a participant's own refusal of a spent or unreadable budget).

The figures are read from the ledger when first needed (so a resumed coordinator has them)
and kept up to date with every record the coordinator commits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lensemble_flwr.errors import PrivacyBudgetRolledBack
from lensemble_flwr.protocol.messages import Update
from lensemble_flwr.provenance.ledger import ContributionRecord

_TOLERANCE = 1e-9
"""Relative slack for floating point: a charge raises epsilon by far more than this."""


class SpentBudgets:
    """Each participant's cumulative epsilon in the newest ledger record that has one.

    Args:
        records: the run's ledger records in round order (read once, on first use).
    """

    def __init__(self, records: Callable[[], Iterable[ContributionRecord]]) -> None:
        self._records = records
        self._spent: dict[str, float] | None = None

    def _loaded(self) -> dict[str, float]:
        if self._spent is None:
            spent: dict[str, float] = {}
            for record in self._records():
                _fold(spent, record)
            self._spent = spent
        return self._spent

    def before(self, participant_id: str) -> float | None:
        """The participant's last recorded cumulative epsilon (None: none recorded)."""
        return self._loaded().get(participant_id)

    def forget(self) -> None:
        """Read the ledger again on next use (a commit whose record was not handed here)."""
        self._spent = None

    def committed(self, record: ContributionRecord) -> None:
        """Take the figures of a record just committed."""
        if self._spent is not None:  # else read with the rest on first use
            _fold(self._spent, record)


def _fold(spent: dict[str, float], record: ContributionRecord) -> None:
    for pid, epsilon in record.epsilon.items():
        if epsilon is not None:
            spent[pid] = float(epsilon)


def check_spent(before: float | None, update: Update) -> None:
    """Refuse ``update`` when it claims no more epsilon than its sender had spent.

    Raises:
        PrivacyBudgetRolledBack: the participant spent ``before`` in an earlier round of
            this run and now claims no more (or no epsilon at all): its budget file was
            deleted or rolled back.
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
