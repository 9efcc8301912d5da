"""Proof bundles: a participant proves one record is in its committed dataset; an auditor
accepts it only against the root the run's ledger recorded for that participant."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from run_dir_helpers import copy_run, federated_run, flip_byte, read_json, synthetic_run

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import CommitmentMismatch, LedgerError
from lensemble_flwr.provenance.commitment_secret import read_commitment_secret
from lensemble_flwr.provenance.inclusion import (
    InclusionProof,
    check_against_ledger,
    committed_root,
    prove_inclusion,
)
from lensemble_flwr.provenance.merkle import leaf_salt, merkle_root
from lensemble_flwr.simulations.toy import ToyTrainer


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = federated_run(tmp_path_factory.mktemp("federation"))
    STATE_DIR[:] = [run_dir.parent / "budgets"]  # federated_run's dp-state-dir
    return run_dir


def records_of(index: int) -> list[bytes]:
    """Participant p0<index>'s records, as its trainer commits to them (see build())."""
    return list(ToyTrainer(index).dataset_records())


STATE_DIR: list[Path] = []  # the run's participants' state directory (dp-state-dir)


def secret_of(index: int) -> bytes:
    """The commitment secret participant p0<index> keeps in its state directory."""
    return read_commitment_secret(STATE_DIR[0], f"p0{index}")


def prove(index: int, record: int, **kwargs) -> InclusionProof:
    """Participant p0<index>'s bundle for one of its records (salted, as it committed)."""
    return prove_inclusion(records_of(index), record, secret=secret_of(index), **kwargs)


def test_a_bundle_from_the_participants_records_is_accepted(run: Path) -> None:
    records = records_of(1)
    bundle = prove(1, 17, participant_id="p01")
    assert (
        bundle.root
        == merkle_root(records, secret_of(1))
        == read_json(run, "ledger/00000001")["dataset_roots"]["p01"]
    )
    assert bundle.salt == leaf_salt(secret_of(1), 17).hex()  # that leaf's salt, no other
    assert base64.b64decode(bundle.record) == records[17] and bundle.size == len(records)
    again = InclusionProof.from_json(bundle.to_json())
    accepted = check_against_ledger(again, Store(run), "p01")
    assert (accepted.root, accepted.index, accepted.rounds) == (bundle.root, 17, (1, 2, 3))


@pytest.mark.parametrize("index", [0, 1, 31, 63])
def test_every_position_proves(run: Path, index: int) -> None:
    check_against_ledger(prove(2, index), Store(run), "p02")


def test_another_participants_root_is_refused(run: Path) -> None:
    bundle = prove(1, 3)
    with pytest.raises(
        CommitmentMismatch, match=r"is not the dataset root \w+ the ledger records for 'p02'"
    ):
        check_against_ledger(bundle, Store(run), "p02")


def test_a_record_that_is_not_the_committed_one_is_refused(run: Path) -> None:
    bundle = prove(1, 3)
    other = base64.b64encode(b"a record p01 never had").decode()
    with pytest.raises(CommitmentMismatch, match="hashes to leaf"):
        check_against_ledger(bundle.model_copy(update={"record": other}), Store(run), "p01")


def test_a_forged_leaf_hash_and_record_do_not_lead_to_the_root(run: Path) -> None:
    forged = prove_inclusion([b"forged"], 0)
    bundle = prove(1, 3).model_copy(
        update={"record": forged.record, "leaf_hash": forged.leaf_hash, "salt": None}
    )
    with pytest.raises(CommitmentMismatch, match="does not lead to the committed root"):
        check_against_ledger(bundle, Store(run), "p01")


def test_a_wrong_sibling_or_size_does_not_verify(run: Path) -> None:
    bundle = prove(1, 3)
    siblings = ("00" * 32, *bundle.siblings[1:])
    with pytest.raises(CommitmentMismatch, match="does not lead"):
        check_against_ledger(bundle.model_copy(update={"siblings": siblings}), Store(run), "p01")
    with pytest.raises(CommitmentMismatch, match="deep"):
        check_against_ledger(bundle.model_copy(update={"size": 4}), Store(run), "p01")
    with pytest.raises(CommitmentMismatch, match="outside a tree of 2"):
        check_against_ledger(bundle.model_copy(update={"size": 2}), Store(run), "p01")


def test_a_participant_that_never_contributed_has_no_root(run: Path) -> None:
    with pytest.raises(LedgerError, match="contributed to no round"):
        committed_root(Store(run), "p99")


def test_the_root_comes_only_from_a_ledger_that_verifies(run: Path, tmp_path: Path) -> None:
    broken = copy_run(run, tmp_path / "broken")
    checkpoint = read_json(broken, "ledger/00000002")["checkpoint"]
    flip_byte(broken / "blobs" / checkpoint[:2] / checkpoint)
    with pytest.raises(LedgerError, match="round 2: checkpoint"):
        check_against_ledger(prove(1, 3), Store(broken), "p01")


def test_an_unbound_participant_has_no_root_to_prove_against(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "syn", [{"a": "aa" * 32, "b": None}])
    with pytest.raises(CommitmentMismatch, match="unbound"):
        committed_root(Store(run), "b")
    assert committed_root(Store(run), "a") == ("aa" * 32, (1,))


def test_two_roots_for_one_participant_are_refused(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "syn", [{"a": "aa" * 32}, {"a": "bb" * 32}])
    with pytest.raises(LedgerError, match="2 dataset roots for 'a'"):
        committed_root(Store(run), "a")


def test_malformed_bundles_are_refused() -> None:
    with pytest.raises(CommitmentMismatch, match="not an inclusion proof bundle"):
        InclusionProof.from_json(b"{}")
    with pytest.raises(CommitmentMismatch, match="format"):
        InclusionProof.from_json(prove_inclusion([b"x"], 0).to_json().replace("proof/1", "proof/9"))
    bad = prove_inclusion([b"x", b"y"], 1).model_copy(update={"record": "not base64!"})
    with pytest.raises(CommitmentMismatch, match="base64"):
        bad.check()


def test_bad_arguments_to_prove() -> None:
    with pytest.raises(ValueError, match="empty"):
        prove_inclusion([], 0)
    with pytest.raises(IndexError):
        prove_inclusion([b"a", b"b"], 2)
    with pytest.raises(IndexError):
        prove_inclusion([b"a", b"b"], -1)
