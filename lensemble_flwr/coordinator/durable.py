"""What the coordinator keeps in the store so that a restarted coordinator can resume.

The committed state itself is already durable: the newest ledger record names the
checkpoint of θ_{t} and its outer-optimizer momentum, and the run manifest holds the
configuration and every attempt. Two more things are needed to pick a run up again:

* **the participant registry** (kept by :mod:`lensemble_flwr.identity.registry_store`) —
  every participant's current commitment (dataset root, example count, public keys) and,
  for masked rounds, each participant's unspent mask key. It is written whenever it
  changed, before anything that depends on it can reach the ledger: when a masked round's
  member set is fixed (spending their keys), and before a round's sum is revealed.
* **the closing entry** — the manifest entry of the round being committed, written just
  before its ledger record. A crash between the record (the commit) and the manifest entry
  then loses nothing: resume writes this entry, not a reconstruction from the record.
* **the external step** — a model changed after the last commit that the next round
  trains from (:mod:`.external_step`), kept before anything is sent from it: a
  restarted coordinator trains from it too, never from the model it replaced.
* **attempt markers** — a name claimed as an attempt starts. An attempt that has a
  marker but no manifest entry was cut short by a crash; on resume it is recorded as
  aborted, so the next attempt gets a fresh number and participants, which answer each
  (round, attempt) only once, answer it.

Every write goes through :class:`~lensemble_flwr.artifacts.store.Store`, so a crash leaves
either the previous version or the new one, never a half-written file.
"""

from __future__ import annotations

from pydantic import ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.provenance.ledger import (  # kept where a joining participant reads it
    EXTERNAL_STEP,
    RoundEntry,
    load_external_step,
    save_external_step,
)

__all__ = [
    "ATTEMPTS",
    "CLOSING",
    "EXTERNAL_STEP",
    "load_closing",
    "load_external_step",
    "mark_started",
    "save_closing",
    "save_external_step",
    "started_attempts",
]

ATTEMPTS = "coordinator/attempts"
CLOSING = "coordinator/closing"


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
