"""Checkpoint retention: keep-last-checkpoints / keep-every-checkpoint prune old checkpoints
after a commit, marker first; the ledger keeps every hash, verify and the audit report
what was pruned, recovery and joining still work, and a pruning cut short leaves a run
that verifies."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.cli import main
from lensemble_flwr.config import LensembleConfig, RetentionConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import ConfigError, LedgerError, StoreError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.ledger import Ledger, RunManifest, is_pruned, pruned_name
from lensemble_flwr.provenance.retention import checkpoints_of, prune, prune_checkpoints
from lensemble_flwr.provenance.verify import verify
from tests.coordinator.test_hash_once import RECORDED, feed_round, unbound_coordinator


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)


def _run(store: Store, rounds: int, **retention: int) -> Coordinator:
    coordinator = unbound_coordinator(store, **retention)
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        feed_round(coordinator, rng)
    return coordinator


def _kept_rounds(store: Store, head: int) -> list[int]:
    return [r for r in range(head + 1) if store.has(checkpoints_of(store, r)[0])]


# -- the policy ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flat", "key"),
    [
        ({"keep-last-checkpoints": -1}, "keep-last-checkpoints"),
        ({"keep-every-checkpoint": -2, "keep-last-checkpoints": 1}, "keep-every-checkpoint"),
        ({"keep-every-checkpoint": 5}, "keep-every-checkpoint"),  # meaningless alone
        ({"keep-last-checkpoints": 1.5}, "keep-last-checkpoints"),
    ],
)
def test_invalid_retention_is_a_config_error(flat: dict, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        LensembleConfig.from_flat(flat)
    assert key in str(caught.value) or caught.value.field in (key, "retention")


def test_the_policy_keeps_the_newest_and_every_kth() -> None:
    assert RetentionConfig().keeps(1, 1000) and not RetentionConfig().prunes  # default: all
    policy = RetentionConfig(keep_last_checkpoints=2, keep_every_checkpoint=3)
    assert [r for r in range(8) if policy.keeps(r, 7)] == [0, 3, 6, 7]
    only_last = RetentionConfig(keep_last_checkpoints=1)
    assert [r for r in range(5) if only_last.keeps(r, 4)] == [4]


def test_retention_is_not_recorded_and_a_resumed_run_may_change_it(tmp_path: Path) -> None:
    coordinator = _run(Store(tmp_path), 2, keep_last_checkpoints=1)
    recorded = RunManifest.load(coordinator.store).config
    assert "keep-last-checkpoints" not in recorded and "keep-every-checkpoint" not in recorded
    other = LensembleConfig(
        federation=coordinator.config.federation.model_dump(),
        retention={"keep_last_checkpoints": 3, "keep_every_checkpoint": 2},
    )
    resumed = Coordinator.resume(other, store=Store(tmp_path))
    assert resumed.global_state().round == 2


# -- pruning ---------------------------------------------------------------------------
def test_default_keeps_every_checkpoint(tmp_path: Path) -> None:
    store = Store(tmp_path)
    _run(store, 4)
    assert _kept_rounds(store, 4) == [0, 1, 2, 3, 4]
    assert audit_run(tmp_path).pruned == ()


def test_pruning_keeps_the_policy_and_every_hash(tmp_path: Path) -> None:
    store = Store(tmp_path)
    _run(store, 7, keep_last_checkpoints=2, keep_every_checkpoint=3)
    assert _kept_rounds(store, 7) == [0, 3, 6, 7]
    records = Ledger(store).records()
    assert [(r.round, r.checkpoint, r.record_hash) for r in records[:3]] == RECORDED
    assert [r.round for r in verify(store)] == list(range(1, 8))
    report = audit_run(tmp_path)
    assert report.ok and report.pruned == (1, 2, 4, 5) and report.checkpoints == 4
    for round in (1, 2):  # the marker says which round the pruned blob held
        digest = checkpoints_of(store, round)[0]
        note = json.loads(store.get(store.resolve(pruned_name(digest))))
        assert note == {"checkpoint": digest, "round": round}


def test_verify_cli_reports_pruned_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(Store(tmp_path), 5, keep_last_checkpoints=1, keep_every_checkpoint=2)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pruned             2 (rounds 1, 3; the ledger keeps their hashes)" in out
    assert main(["verify", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["pruned"] == [1, 3]


def test_a_kept_checkpoint_that_is_wrong_or_gone_is_still_an_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    _run(store, 5, keep_last_checkpoints=2, keep_every_checkpoint=2)  # kept: 0, 2, 4, 5
    wrong = checkpoints_of(store, 2)[0]
    path = tmp_path / "blobs" / wrong[:2] / wrong
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    gone = checkpoints_of(store, 4)[0]
    (tmp_path / "blobs" / gone[:2] / gone).unlink()  # deleted, but not pruned
    report = audit_run(tmp_path)
    assert report.pruned == (1, 3)
    assert [(f.round, f.field) for f in report.findings] == [
        (2, "checkpoint sha256"),
        (4, "checkpoint"),
    ]
    with pytest.raises(LedgerError, match="round 2: checkpoint"):
        verify(store)


def test_a_pruned_newest_checkpoint_is_an_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    _run(store, 2)
    head = Ledger(store).head()
    assert head is not None and prune(store, head.checkpoint, head.round)
    assert is_pruned(store, head.checkpoint)
    with pytest.raises(LedgerError, match="round 2: the newest checkpoint was pruned"):
        verify(store)
    finding = audit_run(tmp_path).first
    assert finding is not None and (finding.round, finding.found) == (2, "pruned")


def _keep_nothing(monkeypatch: pytest.MonkeyPatch) -> RetentionConfig:
    """A policy that keeps no round at all (past the config's own guards)."""
    monkeypatch.setattr(RetentionConfig, "keeps", lambda self, round, head: False)
    return RetentionConfig(keep_last_checkpoints=1)


def test_pruning_never_takes_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path)
    _run(store, 3)
    head = Ledger(store).head()
    assert head is not None
    assert prune_checkpoints(store, _keep_nothing(monkeypatch), head) == 3
    assert _kept_rounds(store, 3) == [3]
    assert [r.round for r in verify(store)] == [1, 2, 3]


def test_a_run_resumes_and_joins_after_pruning(tmp_path: Path) -> None:
    base = small_config()
    config = LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        retention={"keep_last_checkpoints": 1},
    )
    coordinator, network, nodes = federation(tmp_path, config=config)
    coordinator.run(3)
    store = Store(tmp_path / "run")
    assert _kept_rounds(store, 3) == [3]
    assert nodes[0].join(str(store.root)).round == 3  # a joiner gets the newest
    resumed = Coordinator.resume(config, transport=network.coordinator, store=store)
    resumed.run(2)
    assert _kept_rounds(store, 5) == [5]
    assert [r.round for r in verify(store)] == [1, 2, 3, 4, 5]
    assert audit_run(store.root).pruned == (0, 1, 2, 3, 4)


def test_an_adopted_model_is_pruned_with_the_round_it_changed(tmp_path: Path) -> None:
    store = Store(tmp_path)
    coordinator = unbound_coordinator(store, keep_last_checkpoints=1)
    rng = np.random.default_rng(0)
    feed_round(coordinator, rng)
    changed = {n: a + np.float32(0.5) for n, a in coordinator.global_state().params.items()}
    step = coordinator.adopt(changed)
    assert step is not None and store.has(step.checkpoint)
    feed_round(coordinator, rng)  # round 2 trains from the adopted model
    assert not store.has(step.checkpoint) and is_pruned(store, step.checkpoint)
    feed_round(coordinator, rng)
    report = audit_run(tmp_path)
    assert report.ok and report.pruned == (0, 1, 2)
    assert [r.round for r in verify(store)] == [1, 2, 3]


def test_a_pending_external_step_is_never_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path)
    coordinator = unbound_coordinator(store)
    rng = np.random.default_rng(0)
    feed_round(coordinator, rng)
    feed_round(coordinator, rng)
    changed = {n: a * np.float32(0.5) for n, a in coordinator.global_state().params.items()}
    step = coordinator.adopt(changed)
    assert step is not None
    head = Ledger(store).head()
    assert head is not None
    prune_checkpoints(store, _keep_nothing(monkeypatch), head)
    assert _kept_rounds(store, 2) == [2]
    assert store.has(step.checkpoint) and not is_pruned(store, step.checkpoint)
    resumed = Coordinator.resume(coordinator.config, store=Store(tmp_path))
    assert resumed.global_state().params_hash == step.adopted_hash


# -- crash safety ----------------------------------------------------------------------
@pytest.mark.parametrize("cut", ["name", "delete"])
def test_a_pruning_cut_short_leaves_a_run_that_verifies_and_resumes(
    tmp_path: Path, cut: str
) -> None:
    """The store refuses the pruning's marker (a kill before it) or its deletion (a kill
    after the marker, before the blob is gone): the round stays committed, the run
    verifies (a marked checkpoint still there is read as a kept one) and resumes, and
    the next commit prunes what this one could not."""
    store = Store(tmp_path)
    coordinator = _run(store, 2, keep_last_checkpoints=1)
    assert _kept_rounds(store, 2) == [2]

    def cut_short(kind: str, key: str, data: bytes) -> None:
        if kind == cut and (kind == "delete" or key.startswith("pruned/")):
            raise StoreError(f"killed at the {kind}")

    store.on_write = cut_short
    feed_round(coordinator, np.random.default_rng(5))  # round 3 commits; pruning 2 fails
    assert coordinator.outcomes[-1].state is RoundState.CLOSED
    assert _kept_rounds(store, 3) == [2, 3]
    marked = store.bound(pruned_name(checkpoints_of(store, 2)[0]))
    assert bool(marked) == (cut == "delete")
    report = audit_run(tmp_path)
    assert report.ok and report.pruned == (0, 1) and report.checkpoints == 2
    assert [r.round for r in verify(store)] == [1, 2, 3]
    store.on_write = None
    resumed = Coordinator.resume(coordinator.config, store=Store(tmp_path))
    feed_round(resumed, np.random.default_rng(6))
    assert _kept_rounds(store, 4) == [4]
    assert audit_run(tmp_path).pruned == (0, 1, 2, 3)
