"""A process that resumes the same run again and again (a shared-folder participant)
checks each ledger record once (:mod:`lensemble_flwr.provenance.follow`): the same link
rules as ``check="chain"``, a cost per resume that does not grow with the rounds behind
it, and the same refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import Ledger, RunManifest, ledger_name, manifest_entry_name
from lensemble_flwr.provenance.verify import verify


def run_rounds(tmp_path: Path, rounds: int) -> tuple[Coordinator, Store]:
    coordinator, _, _ = federation(tmp_path)
    coordinator.run(rounds)
    return coordinator, coordinator.store


class CountingStore(Store):
    """A Store that counts the blobs it reads."""

    reads = 0

    def get(self, digest: str) -> bytes:
        CountingStore.reads += 1
        return super().get(digest)


def test_a_followed_resume_is_the_resume_a_full_check_gives(tmp_path: Path) -> None:
    coordinator, store = run_rounds(tmp_path, 3)
    config = coordinator.config
    follower = LedgerFollower(store)
    followed = Coordinator.resume(config, store=store, follower=follower)
    full = Coordinator.resume(config, store=store, check="full")
    assert followed.global_state().params_hash == full.global_state().params_hash
    assert followed.next_attempt() == full.next_attempt()
    for name, array in full.momentum().items():
        np.testing.assert_array_equal(followed.momentum()[name], array)
    assert follower.head == Ledger(store).head() == verify(store)[-1]
    assert follower.through == 3
    # and the followed coordinator goes on as the other would: two more rounds verify
    followed.transport = coordinator.transport
    followed.run(2)
    assert [r.round for r in verify(store)] == [1, 2, 3, 4, 5]
    again = Coordinator.resume(config, store=store, follower=follower)
    assert follower.through == 5 and again.global_state().round == 5


def test_a_resume_reads_only_what_was_stored_since_the_last(tmp_path: Path) -> None:
    coordinator, _, _ = federation(tmp_path)
    store = CountingStore(coordinator.store.root)
    config = coordinator.config
    follower = LedgerFollower(store)
    reads = []
    for total in (2, 4, 8, 12):
        coordinator.run(total - coordinator.global_state().round)
        CountingStore.reads = 0
        Coordinator.resume(config, store=store, follower=follower)  # catches up
        CountingStore.reads = 0
        Coordinator.resume(config, store=store, follower=follower)  # nothing new
        reads.append(CountingStore.reads)
    assert len(set(reads)) == 1, reads  # the same in round 12 as in round 2


def test_a_tampered_record_after_the_last_check_is_refused(tmp_path: Path) -> None:
    coordinator, store = run_rounds(tmp_path, 2)
    follower = LedgerFollower(store)
    Coordinator.resume(coordinator.config, store=store, follower=follower)
    coordinator.run(1)
    # round 3's record says it had other contributors than it had
    name = ledger_name(3)
    record = json.loads(store.get(store.resolve(name)))
    record["count"] = record["count"] + 1
    store.bind(name, store.put(canonical_json(record)))
    with pytest.raises(LedgerError, match="round 3"):
        Coordinator.resume(coordinator.config, store=store, follower=follower)
    assert follower.through == 2  # nothing of the broken record was followed


def test_a_changed_manifest_entry_after_the_last_check_is_refused(tmp_path: Path) -> None:
    coordinator, store = run_rounds(tmp_path, 2)
    follower = LedgerFollower(store)
    Coordinator.resume(coordinator.config, store=store, follower=follower)
    coordinator.run(1)
    (entry,) = [e for e in coordinator.manifest.rounds if e.round == 3]
    name = manifest_entry_name(3, entry.attempt)
    changed = entry.model_copy(update={"reason": "edited afterwards"})
    store.bind(name, store.put(canonical_json(changed.model_dump(mode="json"))))
    with pytest.raises(LedgerError, match="round 3"):
        Coordinator.resume(coordinator.config, store=store, follower=follower)


def test_a_round_closed_in_the_manifest_but_not_in_the_ledger_is_refused(tmp_path: Path) -> None:
    coordinator, store = run_rounds(tmp_path, 2)
    (last,) = [e for e in RunManifest.load(store).rounds if e.round == 2]
    forged = last.model_copy(update={"round": 3, "attempt": 1, "state": RoundState.CLOSED})
    RunManifest.load(store).with_round(store, forged)
    with pytest.raises(LedgerError, match="round 3 is closed in the manifest but not"):
        Coordinator.resume(coordinator.config, store=store, follower=LedgerFollower(store))
    with pytest.raises(LedgerError):  # as the whole-run check says too
        Coordinator.resume(coordinator.config, store=store, check="chain")


def test_a_commit_cut_before_its_manifest_entry_is_completed(tmp_path: Path) -> None:
    coordinator, store = run_rounds(tmp_path, 2)
    follower = LedgerFollower(store)
    Coordinator.resume(coordinator.config, store=store, follower=follower)

    def cut(kind: str, key: str, data: bytes) -> None:  # the crash: after the ledger
        if kind == "name" and key.startswith("manifest/rounds/00000003"):
            raise OSError("killed before the manifest entry")

    store.on_write = cut
    with pytest.raises(OSError, match="killed"):
        coordinator.run(1)
    store.on_write = None
    assert store.bound(ledger_name(3)) and not store.bound(manifest_entry_name(3, 1))
    resumed = Coordinator.resume(coordinator.config, store=store, follower=follower)
    assert resumed.global_state().round == 3 and follower.through == 3
    assert store.bound(manifest_entry_name(3, 1))
    assert [r.round for r in verify(store)] == [1, 2, 3]
