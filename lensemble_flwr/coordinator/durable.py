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
  before its ledger record, under a name of its own attempt (``coordinator/closings/
  <round>-<attempt>``; runs written before kept one, ``coordinator/closing``, rebound
  every round). A crash between the record (the commit) and the manifest entry then
  loses nothing: resume writes this entry, not a reconstruction from the record. Its
  bytes are the manifest entry's, so the store keeps them once.
* **the external step** — a model changed after the last commit that the next round
  trains from (:mod:`.external_step`), kept before anything is sent from it: a
  restarted coordinator trains from it too, never from the model it replaced.
* **attempt markers** — a name claimed as an attempt starts (``coordinator/attempts/
  <round>-<attempt>``, one folder for the whole run; runs written before kept a folder
  per round, ``coordinator/attempts/<round>/<attempt>``, which resume still reads). An
  attempt that has a marker but no manifest entry was cut short by a crash; on resume it
  is recorded as aborted, so the next attempt gets a fresh number and participants,
  which answer each (round, attempt) only once, answer it. The name says everything:
  every marker is bound to the same small blob, but for an attempt that trains from an
  external step, whose marker names the adopted model (resume refuses a kept step that
  the round's started attempts did not train from, and a missing one they did).

A plaintext round (no external step, no new binding) thus rebinds no name, makes no
folder and adds no blob beyond its checkpoint, its ledger record and its entry:
rebinding a name replaces a file, which on some filesystems (ext4 mounted with
``discard``) costs several times a new name, and a new folder costs as much as a new
file or more; those costs sat between a round's last reply and the next round's
instructions.
(A masked round still rebinds the registry, which spends its members' mask keys, and a
run with an external step rebinds it.)

Every write goes through :class:`~lensemble_flwr.artifacts.store.Store`, so a crash leaves
either the previous version or the new one, never a half-written file.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError, StoreError
from lensemble_flwr.provenance.ledger import (  # kept where a joining participant reads it
    EXTERNAL_STEP,
    ExternalStep,
    RoundEntry,
    load_external_step,
    save_external_step,
)

__all__ = [
    "ATTEMPTS",
    "CLOSING",
    "CLOSINGS",
    "EXTERNAL_STEP",
    "closing_name",
    "load_closing",
    "load_external_step",
    "mark_started",
    "marker_name",
    "save_closing",
    "save_external_step",
    "started_attempts",
    "started_from",
]

ATTEMPTS = "coordinator/attempts"
CLOSINGS = "coordinator/closings"
CLOSING = "coordinator/closing"
"""The one closing entry of runs written before :data:`CLOSINGS` (read on resume only)."""

_STARTED = canonical_json({"attempt": "started"})
"""What every attempt marker is bound to: the marker's name says which attempt."""


def _marker_name(round: int, attempt: int) -> str:
    return f"{ATTEMPTS}/{round:08d}-{attempt:04d}"  # one folder, as the closings


def _legacy_round_attempts(round: int) -> str:
    return f"{ATTEMPTS}/{round:08d}"  # a folder per round: runs written before


def closing_name(round: int, attempt: int) -> str:
    """The store name the closing entry of ``attempt`` of ``round`` is kept under."""
    return f"{CLOSINGS}/{round:08d}-{attempt:04d}"  # one folder, as the manifest's entries


def marker_name(round: int, attempt: int) -> str:
    """The store name of the start marker of ``attempt`` of ``round``."""
    return _marker_name(round, attempt)


def mark_started(
    store: Store, round: int, attempt: int, external_step: ExternalStep | None = None
) -> None:
    """Record that this attempt started (before its first message goes out), and, when it
    trains from a model an external step adopted, which one: a restarted coordinator
    then holds the step it finds kept against the attempts that started from it.

    Raises:
        LedgerError: the attempt was already started once (attempt numbers never repeat).
    """
    marker = _STARTED
    if external_step is not None:
        marker = canonical_json({"attempt": "started", "adopted_hash": external_step.adopted_hash})
    if not store.claim(_marker_name(round, attempt), store.put(marker)):
        raise LedgerError(f"round {round} attempt {attempt} was already started")


def started_from(store: Store, round: int, attempt: int) -> str | None:
    """The adopted model an attempt's start marker names (None: the committed model).

    Raises:
        LedgerError: the marker is not one :func:`mark_started` writes.
    """
    name = _marker_name(round, attempt)
    try:
        marker = json.loads(store.get(store.resolve(name)))
        if marker.get("attempt") != "started":
            raise ValueError("not a start marker")
        adopted = marker.get("adopted_hash")
        if adopted is not None and not isinstance(adopted, str):
            raise ValueError("adopted_hash is not a hash")
    except (ValueError, AttributeError, StoreError) as exc:
        raise LedgerError(f"{name}: the attempt's start marker does not parse ({exc})") from None
    return adopted


def started_attempts(store: Store, round: int, *, at_least: int = 0) -> list[int]:
    """The attempt numbers of ``round`` that have a start marker, ascending.

    Attempts are numbered 1, 2, ... and each is marked before the next can start, so the
    markers are found by looking up their names in turn (after the round's folder of
    markers, in a run written when each round had one): every number up to
    ``at_least`` (the highest attempt the caller knows of, e.g. from the manifest), then
    on until one is missing. The cost is that of the round's attempts, however long the
    run.
    """
    legacy = [int(n.rsplit("/", 1)[-1]) for n in store.bound(_legacy_round_attempts(round))]
    started = sorted(legacy)
    attempt = (started[-1] if started else 0) + 1
    while True:
        if store.bound(_marker_name(round, attempt)):
            started.append(attempt)
        elif attempt > at_least:
            return started
        attempt += 1


def save_closing(store: Store, entry: RoundEntry) -> None:
    """Keep the manifest entry of the round about to be committed (see the module doc),
    under its attempt's own name: a new name, never a file replaced."""
    name = closing_name(entry.round, entry.attempt)
    digest = store.put(canonical_json(entry.model_dump(mode="json")))
    if not store.claim(name, digest) and store.resolve(name) != digest:
        store.bind(name, digest)  # the same attempt's commit tried again: the newer entry


def load_closing(store: Store, round: int, attempt: int) -> RoundEntry | None:
    """The closing entry kept for ``attempt`` of ``round`` (for a run written before
    closings had names of their own: the one entry it kept, whichever round's it is;
    the caller compares). None when none was kept or it does not parse (the caller
    refuses to resume rather than guess the entry)."""
    name = closing_name(round, attempt)
    if not store.bound(name):
        name = CLOSING
        if not store.bound(name):
            return None
    try:
        return RoundEntry.model_validate_json(store.get(store.resolve(name)))
    except (ValidationError, ValueError):
        return None
