"""What the coordinator keeps in the store so that a restarted coordinator can resume.

The committed state itself is already durable: the newest ledger record names the
checkpoint of θ_{t} and its outer-optimizer momentum, and the run manifest holds the
configuration and every attempt. Two more things are needed to pick a run up again:

* **the participant registry** — every participant's current commitment (dataset root,
  example count, public keys) and, for masked rounds, which members' mask keys were
  revealed and which mask-key shares are kept for them. It is written whenever it changed,
  before anything that depends on it can reach the ledger: before a round's sum is
  revealed, and before a dropped member's mask key is requested.
* **the closing entry** — the manifest entry of the round being committed, written just
  before its ledger record. A crash between the record (the commit) and the manifest entry
  then loses nothing: resume writes this entry, not a reconstruction from the record.
* **attempt markers** — a name claimed as an attempt starts. An attempt that has a
  marker but no manifest entry was cut short by a crash; on resume it is recorded as
  aborted, so the next attempt gets a fresh number and participants, which answer each
  (round, attempt) only once, answer it.

Every write goes through :class:`~lensemble_flwr.artifacts.store.Store`, so a crash leaves
either the previous version or the new one, never a half-written file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.federation.messages import Commitment
from lensemble_flwr.provenance.ledger import RoundEntry
from lensemble_flwr.secagg.membership import Membership

REGISTRY = "coordinator/participants"
SHARES = "coordinator/shares"
ATTEMPTS = "coordinator/attempts"
CLOSING = "coordinator/closing"


class _Registry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    commitments: dict[str, dict[str, Any]]
    membership: dict[str, Any]


def save_registry(
    store: Store, commitments: Mapping[str, Commitment], membership: Membership
) -> None:
    """Replace the stored participant registry with the current one (atomically)."""
    registry = _Registry(
        commitments={p: c.model_dump(mode="json") for p, c in sorted(commitments.items())},
        membership=membership.snapshot(),
    )
    store.bind(REGISTRY, store.put(canonical_json(registry.model_dump(mode="json"))))


def save_shares(store: Store, pid: str, membership: Membership) -> None:
    """Keep ``pid``'s stored mask-key shares under a name of its own: a masked round's
    first update of each member costs one small write, not a rewrite of everyone's."""
    entry = {"pid": pid, **membership.shares_snapshot(pid)}
    store.bind(_shares_name(pid), store.put(canonical_json(entry)))


def _shares_name(pid: str) -> str:
    # participant ids are free text; store names are not
    return f"{SHARES}/{hashlib.sha256(pid.encode()).hexdigest()}"


def load_registry(store: Store) -> tuple[dict[str, Commitment], Membership]:
    """The stored registry and mask-key shares; empty when the run never bound anyone.

    Raises:
        LedgerError: the stored registry or a stored share set does not parse.
    """
    try:
        shares = {}
        for name in store.bound(SHARES):
            entry = json.loads(store.get(store.resolve(name)))
            shares[str(entry.pop("pid"))] = entry
        if not store.bound(REGISTRY):
            return {}, Membership.restore({"compromised": []}, shares)
        registry = _Registry.model_validate_json(store.get(store.resolve(REGISTRY)))
        commitments = {p: Commitment.model_validate(c) for p, c in registry.commitments.items()}
        membership = Membership.restore(registry.membership, shares)
    except (ValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LedgerError(f"participant registry does not parse: {exc}") from None
    return commitments, membership


def _round_attempts(round: int) -> str:
    return f"{ATTEMPTS}/{round:08d}"


def mark_started(store: Store, round: int, attempt: int) -> None:
    """Record that this attempt started (before its first message goes out).

    Raises:
        LedgerError: the attempt was already started once (attempt numbers never repeat).
    """
    marker = store.put(canonical_json({"round": round, "attempt": attempt}))
    if not store.claim(f"{_round_attempts(round)}/{attempt:04d}", marker):
        raise LedgerError(f"round {round} attempt {attempt} was already started")


def started_attempts(store: Store, round: int) -> list[int]:
    """The attempt numbers of ``round`` that have a start marker, ascending (only that
    round's markers are listed, however long the run)."""
    return sorted(int(n.rsplit("/", 1)[-1]) for n in store.bound(_round_attempts(round)))


def save_closing(store: Store, entry: RoundEntry) -> None:
    """Keep the manifest entry of the round about to be committed (see the module doc)."""
    store.bind(CLOSING, store.put(canonical_json(entry.model_dump(mode="json"))))


def load_closing(store: Store) -> RoundEntry | None:
    """The last closing entry kept, or None when none was kept or it does not parse (the
    caller refuses to resume rather than guess the entry)."""
    if not store.bound(CLOSING):
        return None
    try:
        return RoundEntry.model_validate_json(store.get(store.resolve(CLOSING)))
    except (ValidationError, ValueError):
        return None
