"""The commit sequence (lensemble_flwr.coordinator.commit): the ledger record is the
commit point, and after it one rule holds — nothing undoes the round; a failed step is
logged, a failed manifest entry is raised once the round is reported, and failed pruning
is retried by the next commit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from federation_helpers import federation

import lensemble_flwr.coordinator.commit as commit_module
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.commit import after_commit_point
from lensemble_flwr.errors import StoreError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger, RunManifest


def test_a_step_after_the_commit_point_hands_its_error_back_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert after_commit_point(3, "a step", lambda: 7, OSError) == (7, None)

    def fails() -> int:
        raise OSError("disk full")

    with caplog.at_level(logging.ERROR):
        value, error = after_commit_point(3, "a step", fails, OSError)
    assert value is None and isinstance(error, OSError)
    assert "round 3 committed; a step failed: OSError('disk full')" in caplog.text
    with pytest.raises(ValueError):  # what the step may not fail with propagates
        after_commit_point(3, "a step", lambda: int("x"), OSError)


def test_a_failed_manifest_entry_is_raised_after_the_round_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator, _, _ = federation(tmp_path)
    reported: list[Any] = []
    coordinator.core.observers.on_round = reported.append
    original = RunManifest.with_round
    pruned: list[int] = []
    monkeypatch.setattr(commit_module, "prune_checkpoints", lambda *a, **k: pruned.append(1))

    def failing(self: RunManifest, store: Store, entry: Any) -> RunManifest:
        if entry.state is RoundState.CLOSED:
            raise StoreError("the manifest cannot be written")
        return original(self, store, entry)

    monkeypatch.setattr(RunManifest, "with_round", failing)
    with pytest.raises(StoreError, match="cannot be written"):
        coordinator.run(1)
    # committed all the same: the ledger holds it, memory moved, the outcome was reported
    (record,) = Ledger(Store(tmp_path / "run")).records()
    assert coordinator.global_state().params_hash == record.new_global_hash
    assert [o.state for o in reported] == [RoundState.CLOSED]
    assert coordinator.last_close is not None and coordinator.last_close.round == 1
    assert pruned == []  # the evidence is incomplete: nothing is pruned


def test_failed_pruning_is_logged_and_left_to_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, _, _ = federation(tmp_path)
    looked_from: list[int] = []

    def prune(store: Store, policy: Any, head: Any, *, since: int) -> int:
        looked_from.append(since)
        if head.round == 1:
            raise StoreError("cannot unlink")
        return head.round

    monkeypatch.setattr(commit_module, "prune_checkpoints", prune)
    with caplog.at_level(logging.ERROR):
        coordinator.run(3)
    assert "round 1 committed; pruning old checkpoints failed" in caplog.text
    assert looked_from == [0, 0, 2]  # round 2 starts where round 1 could not
    assert coordinator.global_state().round == 3
