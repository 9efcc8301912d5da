"""Where the crash drill can kill a coordinator, and what each kill leaves behind.

The drill (:mod:`lensemble_flwr.simulations.crash_drill`) kills at these points,
tests/end_to_end/test_crash_recovery.py drills every one of them and checks what the ``committed``
flag implies, and docs/recovery.md shows :func:`kill_matrix_table`. Standard library only,
so the docs can render the table without importing the federation.
"""

from __future__ import annotations

import dataclasses

CHECKPOINT_WRITE = "checkpoint-write"
MID_COLLECTING = "mid-collecting"


@dataclasses.dataclass(frozen=True)
class KillPoint:
    """One place the drill can kill the coordinator."""

    name: str
    """A round state the machine enters (its value), or a point inside a state."""
    dies: str
    """When the process dies."""
    committed: bool = False
    """The killed round's ledger record is on disk when the process dies."""
    note: str = ""
    """Anything the restart does beyond what ``committed`` implies."""

    @property
    def verify_before(self) -> str:
        """What ``verify(store)`` reports on the run directory before the restart."""
        if self.committed:
            return (
                "fails with exactly `manifest closed rounds [1..r-1] differ from ledger "
                "rounds [1..r]`"
            )
        return "passes: rounds 1..r-1"

    @property
    def on_resume(self) -> str:
        """What ``Coordinator.resume`` does with the attempt the kill cut short."""
        if self.committed:
            text = "writes the attempt's manifest entry kept before the commit; no retry"
        else:
            text = "records the attempt as aborted (`CoordinatorRestart`), retries the round"
        return f"{text} {self.note}".strip()


KILL_POINTS: tuple[KillPoint, ...] = (
    KillPoint("open", "the attempt's start marker is claimed, its machine created; nothing sent"),
    KillPoint("collecting", "quorum reached: RoundOpens sent, no update admitted yet"),
    KillPoint(
        MID_COLLECTING,
        "as the attempt's second update is admitted: bindings of this attempt and the next "
        "mask keys announced so far are in memory only",
    ),
    KillPoint(
        "aggregating", "the contributing set is frozen, the participant registry stored; no sum"
    ),
    KillPoint(
        "aligning", "the sum is revealed and self-checked (masked: the next mask keys are stored)"
    ),
    KillPoint("committing", "the diagnostics are computed; no checkpoint, no ledger record"),
    KillPoint(
        CHECKPOINT_WRITE,
        "half of the new checkpoint is in a temp file in tmp/; nothing in blobs/ or names/",
    ),
    KillPoint(
        "closed",
        "the ledger record is claimed and RoundClose sent; the manifest entry is kept "
        "under coordinator/closings but not yet in the manifest",
        committed=True,
    ),
    KillPoint(
        "aborted",
        "the attempt aborted (quorum missed) before its manifest entry was written",
        note="(its own abort reason is not kept)",
    ),
)
KILL_POINTS_BY_NAME = {p.name: p for p in KILL_POINTS}


def kill_matrix_table() -> str:
    """The kill points as a markdown table."""
    rows = [
        "| kill point | the process dies | killed round in the ledger | `verify` before the "
        "restart | the restart |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows += [
        f"| `{p.name}` | {p.dies} | {'yes' if p.committed else 'no'} | {p.verify_before} "
        f"| {p.on_resume} |"
        for p in KILL_POINTS
    ]
    return "\n".join(rows)
