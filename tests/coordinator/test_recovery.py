"""A coordinator restarted on its run directory resumes from the last CLOSED round.

These are the in-process checks (a crash is simulated by abandoning the coordinator
object at a chosen point); tests/end_to_end/test_crash_recovery.py kills real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.aggregation.fixed_point import FixedPointAggregator
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator import durable
from lensemble_flwr.coordinator.coordinator import INTERRUPTED, Coordinator
from lensemble_flwr.coordinator.recovery import record_interrupted
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    CommitmentMismatch,
    ConfigError,
    LedgerError,
    RoundError,
    StoreError,
)
from lensemble_flwr.identity import registry_store
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.testing import DeliveryLog
from lensemble_flwr.transports.base import COORDINATOR
from lensemble_flwr.transports.faults import FaultPlan


class Crash(BaseException):
    """Stands for the process dying: nothing catches it."""


def closings_of(store: Store, round: int) -> list[str]:
    """The names of the closing entries kept for ``round``'s attempts."""
    return [n for n in store.bound(durable.CLOSINGS) if f"/{round:08d}-" in n]


def restart(coordinator: Coordinator, **kwargs) -> Coordinator:
    """A new coordinator on the same store and network, as a restarted process would be."""
    return Coordinator.resume(
        coordinator.config, transport=coordinator.transport, store=coordinator.store, **kwargs
    )


def test_resume_continues_exactly_where_the_run_stopped(tmp_path: Path) -> None:
    straight, network_a, _ = federation(tmp_path, name="straight")
    straight.run(5)
    network_a.flush()

    first, network_b, _ = federation(tmp_path, name="resumed")
    first.run(3)
    network_b.flush()
    resumed = restart(first)
    assert resumed.global_state().params_hash == first.global_state().params_hash
    assert resumed.global_state().round == 3
    assert resumed.momentum().keys() == first.momentum().keys()
    assert all((resumed.momentum()[n] == a).all() for n, a in first.momentum().items())
    resumed.run(2)
    # same participants, same seeds: the restart changes nothing the run computes
    assert resumed.global_state().params_hash == straight.global_state().params_hash
    records = verify(resumed.store)
    assert [r.round for r in records] == [1, 2, 3, 4, 5]
    assert resumed.outcomes[0].attempt == 1  # nothing was in flight at the restart


def test_bindings_survive_a_restart(tmp_path: Path) -> None:
    def forge_root(payload: dict) -> dict:
        payload["dataset_root"] = "f" * 64
        return payload

    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    network.flush()
    resumed = restart(coordinator)
    assert set(resumed.registry.commitments) == {"p00", "p01", "p02", "p03"}
    assert not resumed.round_open_for("p00").needs_commitment  # still one exchange a round
    network.faults.corrupt("p01", round=2, kind=MessageKind.UPDATE, mutate=forge_root)
    with pytest.raises(CommitmentMismatch, match="p01"):
        resumed.run(1)


class CrashingAggregator(FixedPointAggregator):
    """The exact aggregator, except that revealing round ``crash_round``'s sum dies."""

    crash_round: int | None = None
    round: int = 1

    def reveal(self):
        if self.round == CrashingAggregator.crash_round:
            raise Crash
        return super().reveal()


def crashing_factory(template, config, seed):
    aggregator = CrashingAggregator(template, config, check_seed=seed)
    aggregator.round = crashing_factory.round
    crashing_factory.round += 1
    return aggregator


def test_an_interrupted_attempt_is_recorded_and_the_round_retried(tmp_path: Path) -> None:
    crashing_factory.round = 0
    CrashingAggregator.crash_round = 1
    coordinator, network, _ = federation(tmp_path, aggregator_factory=crashing_factory)
    coordinator.run(1)
    # the crash comes while the round is being summed
    with pytest.raises(Crash):
        coordinator.run(1)
    assert coordinator.round_state() is RoundState.AGGREGATING
    resumed = restart(coordinator)
    entry = resumed.manifest.rounds[-1]
    assert (entry.round, entry.attempt, entry.state, entry.reason) == (
        2,
        1,
        RoundState.ABORTED,
        INTERRUPTED,
    )
    assert resumed.next_attempt() == 2
    resumed.run(1)
    assert resumed.outcomes[-1].attempt == 2 and resumed.outcomes[-1].count == 4
    assert [r.round for r in verify(resumed.store)] == [1, 2]
    assert network.crashes == []


def cut_round_two_before_its_manifest_entry(tmp_path: Path) -> Coordinator:
    """A federation that closed round 1 and crashed in round 2 right after its ledger
    record was written, before its manifest entry."""
    coordinator, _network, _ = federation(tmp_path)
    coordinator.run(1)
    real = RunManifest.with_round

    def crash_after_ledger(self, store, entry):
        if entry.state is RoundState.CLOSED:
            raise Crash  # the ledger record is written, the manifest entry is not
        return real(self, store, entry)

    RunManifest.with_round = crash_after_ledger
    try:
        with pytest.raises(Crash):
            coordinator.run(1)
    finally:
        RunManifest.with_round = real
    return coordinator


def test_a_commit_cut_short_before_its_manifest_entry_is_completed(tmp_path: Path) -> None:
    coordinator = cut_round_two_before_its_manifest_entry(tmp_path)
    with pytest.raises(LedgerError):
        verify(coordinator.store)  # the half-done commit is visible as such
    (entry_name,) = closings_of(coordinator.store, 2)
    entry_file = coordinator.store.root / "names" / entry_name
    kept = entry_file.read_bytes()
    entry_file.unlink()  # without the entry kept before the commit, nothing is guessed
    with pytest.raises(LedgerError, match="in the ledger but not in the manifest"):
        restart(coordinator)
    entry_file.write_bytes(kept)
    resumed = restart(coordinator)
    assert resumed.global_state().round == 2  # round 2 was committed: it is not lost
    (entry,) = (e for e in resumed.manifest.rounds if e.round == 2)
    assert entry.diagnostics["mean_delta_l2"] > 0  # what the live attempt knew
    assert [r.round for r in verify(resumed.store)] == [1, 2]
    resumed.run(1)
    assert [r.round for r in verify(resumed.store)] == [1, 2, 3]


def test_a_cut_commit_of_a_run_that_kept_one_closing_entry_is_completed(
    tmp_path: Path,
) -> None:
    """A run directory of an earlier version kept the closing entry under one name
    (``coordinator/closing``), rebound every round: resume still completes from it, and
    refuses it when it holds another round's entry."""
    coordinator = cut_round_two_before_its_manifest_entry(tmp_path)
    names = coordinator.store.root / "names"
    (entry_name,) = closings_of(coordinator.store, 2)
    (earlier_name,) = closings_of(coordinator.store, 1)
    kept, earlier = (names / entry_name).read_bytes(), (names / earlier_name).read_bytes()
    for old in coordinator.store.bound(durable.CLOSINGS):  # the earlier layout
        (names / old).unlink()
    (names / durable.CLOSING).write_bytes(earlier)  # another round's entry: not guessed
    with pytest.raises(LedgerError, match="another round's"):
        restart(coordinator)
    (names / durable.CLOSING).write_bytes(kept)
    resumed = restart(coordinator)
    assert resumed.global_state().round == 2
    assert [r.round for r in verify(resumed.store)] == [1, 2]


def test_a_closing_entry_kept_again_for_the_same_attempt_replaces_the_first(
    tmp_path: Path,
) -> None:
    """Closing entries are claimed, not rebound; if the same attempt's entry is kept
    twice with other contents, the newer one is what resume reads."""
    coordinator, _network, _ = federation(tmp_path)
    coordinator.run(1)
    store = coordinator.store
    entry = RunManifest.entry(store, 1, 1)
    assert entry is not None and entry.state is RoundState.CLOSED
    assert durable.load_closing(store, 1, entry.attempt) == entry
    changed = entry.model_copy(update={"diagnostics": {**entry.diagnostics, "x": 1.0}})
    durable.save_closing(store, changed)
    assert durable.load_closing(store, 1, entry.attempt) == changed
    assert durable.load_closing(store, 1, entry.attempt + 1) is None  # none kept, no old one


def test_a_round_replaces_no_name_and_adds_three_blobs(tmp_path: Path) -> None:
    """Between its last reply and the next round, the commit writes new names only
    (replacing a file is what costs on ext4 with ``discard``), and three new blobs:
    the checkpoint, the ledger record and the manifest entry (the closing entry shares
    the entry's bytes; every attempt marker the same blob)."""
    coordinator, _network, _ = federation(tmp_path)
    coordinator.run(2)  # bindings, the registry
    store = coordinator.store
    before = set(store.bound())
    writes: list[tuple[str, str]] = []
    store.on_write = lambda kind, key, data: writes.append((kind, key))
    coordinator.run(3)
    names = [key for kind, key in writes if kind == "name"]
    assert len(names) == len(set(names))
    assert not before & set(names), "a name bound before was written again"
    blobs = {key for kind, key in writes if kind == "blob"}
    assert len(blobs) == 3 * 3


def test_a_round_makes_its_files_while_it_waits_for_replies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making a file or a folder is what a small write costs on some filesystems: a
    plaintext round's writes take the temp files its coordinator made once its
    instructions were out (``Store.prepare_writes``), and no write makes a folder under
    ``names/`` (one folder holds every attempt marker)."""
    coordinator, _network, _ = federation(tmp_path)
    coordinator.run(2)  # bindings, the registry
    store = coordinator.store
    taken: list[bool] = []  # per temp file a write took: was it a prepared one?
    real_take = Store._temp_file
    monkeypatch.setattr(
        Store, "_temp_file", lambda self: (taken.append(bool(self._spares)), real_take(self))[1]
    )
    folders = lambda: {p for p in (store.root / "names").rglob("*") if p.is_dir()}  # noqa: E731
    before = folders()
    coordinator.run(3)
    assert len(taken) >= 3 * 6 and all(taken), taken
    assert folders() == before
    assert durable.started_attempts(store, 4) == [1]  # found in the one folder


def test_resume_refuses_another_config_an_empty_store_and_a_broken_ledger(
    tmp_path: Path,
) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    other = small_config(min_participants=2)
    with pytest.raises(ConfigError, match="min-participants"):
        Coordinator.resume(other, transport=network.coordinator, store=coordinator.store)
    with pytest.raises(StoreError):
        Coordinator.resume(
            coordinator.config, transport=network.coordinator, store=Store(tmp_path / "empty")
        )
    # a ledger record edited on disk: the run is not resumed
    name = coordinator.store.root / "names" / "ledger"
    first = sorted(p for p in name.rglob("*") if p.is_file())[0]
    second = sorted(p for p in name.rglob("*") if p.is_file())[1]
    first.write_text(second.read_text())
    with pytest.raises(LedgerError):
        restart(coordinator)


def test_attempt_markers_of_a_run_that_kept_a_folder_per_round_are_read(
    tmp_path: Path,
) -> None:
    """A run directory of an earlier version kept each round's markers in a folder of
    its own (``coordinator/attempts/<round>/<attempt>``): resume still finds them, and
    the attempts marked after them in the one folder."""
    store = Store(tmp_path / "s")
    started = store.put(b'{"attempt":"started"}')
    for attempt in (1, 2):  # the earlier layout
        assert store.claim(f"{durable.ATTEMPTS}/00000003/{attempt:04d}", started)
    durable.mark_started(store, 3, 3)  # after the upgrade
    durable.mark_started(store, 4, 1)
    assert durable.started_attempts(store, 3) == [1, 2, 3]
    assert durable.started_attempts(store, 4) == [1]
    assert durable.started_attempts(store, 5) == []


def test_markers_past_a_gap_are_found_up_to_the_attempts_the_caller_knows(
    tmp_path: Path,
) -> None:
    """Markers are numbered without gaps today; should one appear, the markers up to the
    highest attempt the manifest knows are still found (resume passes it)."""
    store = Store(tmp_path / "s")
    durable.mark_started(store, 5, 1)
    durable.mark_started(store, 5, 3)  # as if attempt 2's marker were missing
    durable.mark_started(store, 5, 4)
    assert durable.started_attempts(store, 5) == [1]
    assert durable.started_attempts(store, 5, at_least=2) == [1, 3, 4]


def test_resume_records_an_interrupted_attempt_past_a_missing_marker(tmp_path: Path) -> None:
    """Resume looks for markers up to the attempts the manifest knows: an attempt that
    started and never ended is recorded as interrupted even if an earlier attempt's
    marker is missing."""
    coordinator, _network, _ = federation(tmp_path)
    coordinator.run(1)
    store = coordinator.store
    coordinator.begin_attempt()  # round 2, attempt 1: ends aborted, with its entry
    coordinator.abort(RoundError("test: an attempt that aborted"))
    durable.mark_started(store, 2, 2)  # attempt 2 started; the process died in it
    (store.root / "names" / durable.ATTEMPTS / "00000002-0001").unlink()
    manifest = record_interrupted(store, coordinator.manifest, coordinator.global_state())
    assert [(e.round, e.attempt, e.reason) for e in manifest.rounds if e.round == 2] == [
        (2, 1, "RoundError: test: an attempt that aborted"),
        (2, 2, INTERRUPTED),
    ]


def test_a_round_whose_writes_cannot_be_prepared_still_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Preparing the files ahead only saves time: when it fails, the round's writes make
    their own files, and the failure is logged, not an abort."""

    def refuse(store: Store, count: int) -> None:
        raise StoreError("tmp/: cannot prepare writes: No space left on device")

    monkeypatch.setattr(Store, "prepare_writes", refuse)
    coordinator, _network, _ = federation(tmp_path)
    with caplog.at_level("WARNING"):
        coordinator.run(2)
    assert [o.state for o in coordinator.outcomes] == [RoundState.CLOSED] * 2
    assert "not prepared ahead" in caplog.text and "No space left" in caplog.text
    assert [r.round for r in verify(coordinator.store)] == [1, 2]


def test_attempt_markers_never_repeat(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    durable.mark_started(store, 3, 1)
    durable.mark_started(store, 3, 2)
    durable.mark_started(store, 30, 1)
    assert durable.started_attempts(store, 3) == [1, 2]
    with pytest.raises(LedgerError, match="round 3 attempt 2"):
        durable.mark_started(store, 3, 2)


def test_a_malformed_registry_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.bind(registry_store.REGISTRY, store.put(b'{"commitments": {"p": {"kind": "x"}}}'))
    with pytest.raises(LedgerError, match="registry"):
        registry_store.load_registry(store)


def test_unspent_and_spent_mask_keys_survive_a_restart(tmp_path: Path) -> None:
    config = small_config(min_participants=3, secagg_threshold=3)
    faults = FaultPlan().drop("p03", round=2, at=RoundState.COLLECTING)
    coordinator, _network, _ = federation(tmp_path, participants=4, config=config, faults=faults)
    coordinator.run(2)  # round 2 spends p03's key; it announces no next one
    assert sorted(coordinator.registry.membership.mask_keys) == ["p00", "p01", "p02"]
    resumed = restart(coordinator)
    assert resumed.registry.membership.snapshot() == coordinator.registry.membership.snapshot()
    resumed.run(1)
    assert resumed.outcomes[-1].state is RoundState.CLOSED


def test_a_participant_that_lost_its_keys_refuses_then_commits_fresh_ones(
    tmp_path: Path,
) -> None:
    """p01 loses its masking state between rounds (a node restored from an old backup):
    the round lists a key it no longer holds, so it masks nothing and says so; its key is
    spent all the same, so the next round has it commit a fresh one, and it masks again."""
    config = small_config(min_participants=3, secagg_threshold=3)
    coordinator, network, nodes = federation(tmp_path, participants=4, config=config)
    coordinator.run(1)
    lost = next(n for n in nodes if n.participant_id == "p01")
    lost.masking.announced.clear()
    seen = DeliveryLog(network, dest=COORDINATOR)
    coordinator.run(2)
    first, second = coordinator.outcomes[1:]
    assert first.state is RoundState.CLOSED and "p01" not in first.contributors
    entry = coordinator.manifest.rounds[1]
    assert "never announced, or already used" in entry.refused["p01"]
    assert second.count == 4
    recommitted = [
        p for p in seen.payloads() if kind_of(p) is MessageKind.COMMITMENT and p["round"] == 3
    ]
    assert [p["participant_id"] for p in recommitted] == ["p01"]


def test_a_chain_check_resume_reads_only_the_checkpoint_it_resumes_from(tmp_path: Path) -> None:
    coordinator, _network, _ = federation(tmp_path)
    coordinator.run(3)
    records = verify(coordinator.store)
    old = records[0].checkpoint  # rot an old checkpoint: a full check refuses, chain does not
    blob = coordinator.store.root / "blobs" / old[:2] / old
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x00")
    with pytest.raises(LedgerError, match="round 1: checkpoint"):
        restart(coordinator)
    resumed = restart(coordinator, check="chain")
    assert resumed.global_state().params_hash == coordinator.global_state().params_hash
    head = records[-1].checkpoint  # the checkpoint it resumes from is always checked
    blob = coordinator.store.root / "blobs" / head[:2] / head
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CheckpointIntegrityError):
        restart(coordinator, check="chain")
