"""What ``lensemble-flwr verify`` and ``show`` say about a run's endorsements: every
record's status under the run's policy, in one line and as JSON.

The policy and the checks are in :mod:`lensemble_flwr.identity.endorsement`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import LedgerError, StoreError
from lensemble_flwr.identity.endorsement import RecordEndorsement, endorsement_review
from lensemble_flwr.provenance.ledger import (
    MANIFEST_HEADER,
    EndorsementPolicy,
    Ledger,
    RunManifest,
)
from lensemble_flwr.provenance.verify import LinkBreak


def review_run(
    store: Store,
) -> tuple[EndorsementPolicy | None, list[RecordEndorsement], list[LinkBreak]] | None:
    """The run's policy, every record's endorsement and the broken links, for a report
    (``lensemble-flwr verify`` and ``show``); None when the ledger or the manifest header
    cannot be read (the report's own checks name why)."""
    try:
        header = RunManifest.from_header(store.get(store.resolve(MANIFEST_HEADER)))
        records = Ledger(store).records()
    except (LedgerError, StoreError):
        return None
    policy = header.endorsement
    reviews, breaks = endorsement_review(store, records, policy, config=header.config)
    return policy, reviews, breaks


def summary(policy: EndorsementPolicy | None, reviews: Sequence[RecordEndorsement]) -> str:
    """One line on a run's endorsements (what ``verify`` and ``show`` print)."""
    if policy is None:
        return "none: the run was written before endorsements (its history rests on its writer)"
    by_status: dict[str, list[int]] = {}
    for review in reviews:
        by_status.setdefault(review.status, []).append(review.round)
    words = {
        "endorsed": "endorsed",
        "pending": "not yet endorsed (pin the head with --expect-head)",
        "keyless": "cannot be endorsed: no contributor holds an identity key (they rest "
        "on the writer alone)",
        "unendorsed": "UNENDORSED",
    }
    parts = [
        f"round{'s' if len(by_status[s]) > 1 else ''} {round_spans(by_status[s])} {words[s]}"
        for s in ("endorsed", "unendorsed", "keyless", "pending")
        if s in by_status
    ]
    return f"policy {policy}; " + ("; ".join(parts) if parts else "no records yet")


def round_spans(rounds: Sequence[int]) -> str:
    """``0-3, 5, 7-8``: ascending rounds as ranges."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def endorsements_json(
    policy: EndorsementPolicy | None,
    reviews: Sequence[RecordEndorsement],
    breaks: Sequence[LinkBreak],
) -> dict[str, object]:
    """The endorsement part of ``verify --json`` and ``show --json``."""
    return {
        "policy": policy,
        "summary": summary(policy, reviews),
        "records": [dataclasses.asdict(r) | {"missing": list(r.missing)} for r in reviews],
        "broken": [b.message for b in breaks],
    }
