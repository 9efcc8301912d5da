"""A run directory as rows: one per round attempt, with what the ledger adds to it.

The manifest lists every attempt (closed or aborted); a closed attempt's ledger record
adds each contributor's cumulative epsilon. This is what ``lensemble-flwr show`` prints
and ``lensemble-flwr report`` plots. It reads; it checks nothing (``audit_run`` does).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lensemble_flwr.privacy.guarantee import PrivacyGuarantee
from lensemble_flwr.protocol.round import RoundState, TerminalState
from lensemble_flwr.provenance.audit import open_run
from lensemble_flwr.provenance.ledger import FRAME_DRIFT, Ledger, RunManifest


@dataclasses.dataclass(frozen=True)
class AttemptSummary:
    """One attempt of one round."""

    round: int
    attempt: int
    state: TerminalState
    count: int  # C_t (0 for an aborted attempt)
    contributors: tuple[str, ...]
    late: tuple[str, ...]
    refused: dict[str, str]
    reason: str | None
    secure_sum: bool
    diagnostics: dict[str, float]
    epsilon: dict[str, float | None]  # cumulative, after this round's release (closed only)
    new_global_hash: str | None
    unbound: tuple[str, ...] = ()  # contributors bound to no dataset commitment (closed only)
    external_change: float | None = None  # trained from a model changed after its commit:
    # the change's L2 norm (a wrapping strategy's central noise); None: the committed one
    privacy: dict[str, Any] | None = None  # what the epsilon figures hold against (closed)

    @property
    def epsilon_max(self) -> float | None:
        """The largest cumulative epsilon among the contributors (None: no DP release)."""
        spent = [e for e in self.epsilon.values() if e is not None]
        return max(spent) if spent else None

    @property
    def frame_drift(self) -> float | None:
        return self.diagnostics.get(FRAME_DRIFT)

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON-able values, plus ``epsilon_max`` and ``frame_drift``."""
        out = dataclasses.asdict(self)
        out["epsilon_max"] = self.epsilon_max
        out["frame_drift"] = self.frame_drift
        return out


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """A run's attempts, in order, and what they add up to."""

    run_id: str
    initial_params_hash: str
    attempts: tuple[AttemptSummary, ...]
    head_record_hash: str | None

    @property
    def closed(self) -> tuple[AttemptSummary, ...]:
        return tuple(a for a in self.attempts if a.state is RoundState.CLOSED)

    @property
    def aborted(self) -> tuple[AttemptSummary, ...]:
        return tuple(a for a in self.attempts if a.state is RoundState.ABORTED)

    @property
    def final_global_hash(self) -> str:
        """The global state the run ends on (θ_0's hash when no round closed)."""
        closed = self.closed
        return (closed[-1].new_global_hash or "") if closed else self.initial_params_hash

    def epsilon_spent(self) -> dict[str, float]:
        """Each participant's largest recorded cumulative epsilon (DP releases only)."""
        spent: dict[str, float] = {}
        for attempt in self.closed:
            for pid, eps in attempt.epsilon.items():
                if eps is not None:
                    spent[pid] = max(eps, spent.get(pid, eps))
        return dict(sorted(spent.items()))

    def guarantees(self) -> list[PrivacyGuarantee]:
        """The distinct privacy guarantees of the closed rounds, in order of appearance."""
        seen: list[PrivacyGuarantee] = []
        for attempt in self.closed:
            if attempt.privacy is not None:
                guarantee = PrivacyGuarantee.model_validate(attempt.privacy)
                if guarantee not in seen:
                    seen.append(guarantee)
        return seen

    def diagnostic_names(self) -> list[str]:
        """Every diagnostic any attempt recorded, sorted."""
        return sorted({name for a in self.attempts for name in a.diagnostics})

    def to_json(self) -> dict[str, Any]:
        """The run's totals and final hashes, and every attempt (what ``show --json``
        prints)."""
        return {
            "run_id": self.run_id,
            "initial_params_hash": self.initial_params_hash,
            "final_global_hash": self.final_global_hash,
            "head_record_hash": self.head_record_hash,
            "rounds_closed": len(self.closed),
            "attempts_aborted": len(self.aborted),
            "epsilon_spent": self.epsilon_spent(),
            "attempts": [a.to_json() for a in self.attempts],
        }


def summarize_run(run_dir: str | os.PathLike[str]) -> RunSummary:
    """Read a run directory's manifest and ledger into a :class:`RunSummary`.

    Raises:
        NotARunDirectory: not a run directory.
        StoreError: a name or blob it refers to is missing.
        CheckpointIntegrityError: a manifest entry or ledger record does not hash to its
            address.
        LedgerError: an entry or record does not parse.
    """
    store = open_run(run_dir)
    manifest = RunManifest.load(store)
    records = Ledger(store).records()
    # only a closed attempt has a record, so an aborted one finds no epsilon here
    epsilon = {(r.round, r.attempt): r.epsilon for r in records}
    unbound = {(r.round, r.attempt): r.unbound for r in records}
    privacy = {
        (r.round, r.attempt): r.privacy.model_dump(mode="json") for r in records if r.privacy
    }
    attempts = tuple(
        AttemptSummary(
            round=e.round,
            attempt=e.attempt,
            state=e.state,
            count=e.count,
            contributors=e.contributors,
            late=e.late,
            refused=dict(e.refused),
            reason=e.reason,
            secure_sum=e.secure_sum,
            diagnostics=dict(e.diagnostics),
            epsilon=dict(epsilon.get((e.round, e.attempt), {})),
            new_global_hash=e.new_global_hash,
            unbound=unbound.get((e.round, e.attempt), ()),
            external_change=e.external_step.change_norm if e.external_step else None,
            privacy=privacy.get((e.round, e.attempt)),
        )
        for e in sorted(manifest.rounds, key=lambda e: (e.round, e.attempt))
    )
    return RunSummary(
        run_id=manifest.run_id,
        initial_params_hash=manifest.initial_params_hash,
        attempts=attempts,
        head_record_hash=records[-1].record_hash if records else None,
    )
