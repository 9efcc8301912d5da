"""The coordinator holds each participant to the cumulative epsilon the ledger records for
it: an update that claims no more (a budget file deleted or rolled back on the node) is
refused, and the federation stops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import dp_config, federation

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.admission import Verdict
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.spent import SpentBudgets, check_spent
from lensemble_flwr.errors import (
    ForgedMessage,
    PrivacyBudgetExceeded,
    PrivacyBudgetRolledBack,
    response_to,
)
from lensemble_flwr.identity.signing import IdentityKey, verify_signature
from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.participant.release_chain import release_pipeline
from lensemble_flwr.protocol.messages import MessageKind, Update
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import ContributionRecord, Ledger, RoundEntry, RunManifest
from lensemble_flwr.transports.faults import FaultPlan
from lensemble_flwr.transports.inprocess import InProcessNetwork
from tests.coordinator.test_admission import coordinator_in


def update(epsilon: float | None) -> Update:
    return Update(
        run_id="r", round=2, sender="p01", participant_id="p01", dataset_root=None,
        delta={"w": np.zeros(2, np.float32)}, l2_norm=0.0, num_examples=1,
        transforms=("difference",), epsilon=epsilon,
    )  # fmt: skip


def test_an_update_must_claim_more_than_was_spent_before() -> None:
    check_spent(None, update(0.9))  # nothing recorded yet
    check_spent(None, update(None))
    check_spent(2.3, update(2.31))
    for claimed in (0.9, 2.3, None):
        with pytest.raises(PrivacyBudgetRolledBack) as caught:
            check_spent(2.3, update(claimed))
        shown = "none" if claimed is None else f"{claimed:g}"
        assert f"rolled back or deleted: epsilon 2.3 spent before, {shown} claimed" in str(
            caught.value
        )
    assert isinstance(caught.value, PrivacyBudgetExceeded)  # fail-closed: the federation stops
    assert response_to(caught.value) is response_to(PrivacyBudgetExceeded("spent"))


def test_a_wiped_node_is_refused_at_its_next_release(tmp_path: Path) -> None:
    """A node whose budget file and state are both gone (a new disk, a restore from an old
    backup) would release on a fresh budget; the ledger says what it had spent."""
    config = dp_config(tmp_path / "budgets", dp_epsilon=50.0)
    coordinator, _, nodes = federation(tmp_path, config=config)
    coordinator.run(1)
    for path in (tmp_path / "budgets").glob("participant-*.json"):
        path.unlink()
    for node in nodes:  # as a new process builds it: its budget read from the (empty) file
        node.pipeline = release_pipeline(
            config, participant_id=node.participant_id, dataset_root=node.dataset_root,
            budget_key=node.stable_id,
        )  # fmt: skip
        node.import_state(PortableState(arrays={}, meta={}))  # nothing it remembers
    with pytest.raises(PrivacyBudgetRolledBack, match="rolled back or deleted: epsilon"):
        coordinator.run(1)
    records = Ledger(Store(tmp_path / "run")).records()
    assert len(records) == 1  # the refused release entered no sum
    assert coordinator.outcomes[-1].state is RoundState.ABORTED


def test_what_was_spent_is_read_from_the_ledger(tmp_path: Path) -> None:
    """A resumed coordinator starts from the ledger: the figures survive it."""
    config = dp_config(tmp_path / "budgets", dp_epsilon=50.0)
    coordinator, _, _ = federation(tmp_path, config=config)
    coordinator.run(2)
    records = Ledger(Store(tmp_path / "run")).records()
    spent = SpentBudgets(Ledger(Store(tmp_path / "run")).records)
    assert {p: spent.before(p) for p in records[-1].contributors} == records[-1].epsilon
    assert spent.before("nobody") is None
    live = coordinator.core.spent  # kept up to date by the commits, without re-reading
    assert {p: live.before(p) for p in records[-1].contributors} == records[-1].epsilon


def test_the_claimed_epsilon_is_covered_by_the_signature() -> None:
    """A relay cannot raise (or lower) what a signing participant says it spent: the
    cumulative epsilon is one of the fields the participant signs."""
    key = IdentityKey.generate()
    signed = key.sign(update(2.3), 5)
    verify_signature(signed, key.public_openssh, 5)
    forged = signed.model_copy(update={"epsilon": 9.9})
    with pytest.raises(ForgedMessage, match="not signed by its registered identity key"):
        verify_signature(forged, key.public_openssh, 5)


@pytest.mark.parametrize(
    ("error", "stops"),
    [("PrivacyBudgetExceeded", False), ("PrivacyBudgetUnreadable", True),
     ("PrivacyBudgetRolledBack", True)],
)  # fmt: skip
def test_under_sampling_only_a_spent_budget_is_expected(
    tmp_path: Path, error: str, stops: bool
) -> None:
    """A sampled participant asked past its plan refuses and the others go on; one whose
    budget file it cannot trust (unreadable, rolled back) stops the federation, as it does
    without sampling."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING, sample_fraction=0.5)
    assert coordinator.attempt is not None
    coordinator.attempt.invited.add("p00")
    refusal = {
        "kind": MessageKind.REFUSAL.value, "run_id": "run", "round": 1, "attempt": 1,
        "sender": "p00", "participant_id": "p00", "error": error, "reason": "budget",
    }  # fmt: skip
    if stops:
        with pytest.raises(PrivacyBudgetExceeded):
            coordinator.receive(refusal)
    else:
        assert coordinator.receive(refusal) is Verdict.REFUSED
    assert "p00" in coordinator.attempt.refused


# -- releases the coordinator saw in attempts that aborted ------------------------------
def aborted_with_admitted(tmp_path: Path) -> tuple[Coordinator, InProcessNetwork, list, dict]:
    """Round 1 commits; round 2's first attempt admits p00's and p01's updates and
    aborts (p02's and p03's come after the collect timeout: below the quorum of 3).
    Returns the federation and what p00 held after round 1: its budget file's bytes and
    its exported state, i.e. a backup taken after the last committed round."""
    config = dp_config(tmp_path / "budgets", dp_epsilon=50.0)
    faults = FaultPlan().delay("p02", round=2, seconds=100.0)
    faults.delay("p03", round=2, seconds=100.0)
    coordinator, network, nodes = federation(tmp_path, config=config, faults=faults)
    coordinator.run(1)
    backup = {
        "file": (tmp_path / "budgets" / "participant-p00.json").read_bytes(),
        "state": nodes[0].export_state(),
    }
    outcome = coordinator.run_attempt()
    assert outcome.state is RoundState.ABORTED and outcome.round == 2
    return coordinator, network, nodes, backup


def restore(tmp_path: Path, node: Participant, backup: dict) -> None:
    """Put p00's budget file and state back as the backup holds them."""
    (tmp_path / "budgets" / "participant-p00.json").write_bytes(backup["file"])
    node.import_state(backup["state"])


def test_an_aborted_attempts_entry_keeps_what_its_updates_claimed(tmp_path: Path) -> None:
    coordinator, _, _, _ = aborted_with_admitted(tmp_path)
    store = Store(tmp_path / "run")
    (committed,) = Ledger(store).records()
    entry = RunManifest.entry(store, 2, 1)
    assert entry is not None and entry.state is RoundState.ABORTED
    assert entry.epsilon is not None and sorted(entry.epsilon) == ["p00", "p01"]
    assert entry.epsilon["p00"] > committed.epsilon["p00"]  # a release beyond the ledger
    assert coordinator.core.spent.before("p00") == entry.epsilon["p00"]
    assert RunManifest.entry(store, 1, 1).epsilon == committed.epsilon  # the closing one's
    plain, _, _ = federation(tmp_path, name="plain")
    plain.run(1)
    unset = RunManifest.entry(Store(tmp_path / "plain"), 1, 1)
    assert unset is not None and "epsilon" not in unset.model_dump(mode="json")  # as before


@pytest.mark.parametrize("resumed", [False, True], ids=["same-coordinator", "resumed"])
def test_a_node_restored_to_before_a_release_of_an_aborted_attempt_is_refused(
    tmp_path: Path, resumed: bool
) -> None:
    """The coordinator used to compare a claim with the newest committed ledger figure
    only. A node restored (budget file and state) from a backup taken after the last
    committed round, but before its release into an attempt that then aborted, released
    that epsilon again and passed: its claim was above the committed figure. Now the
    largest figure any admitted update claimed counts, aborted attempts included, and a
    resumed coordinator reads it back from the manifest."""
    coordinator, network, nodes, backup = aborted_with_admitted(tmp_path)
    seen = RunManifest.entry(Store(tmp_path / "run"), 2, 1).epsilon["p00"]
    committed = Ledger(Store(tmp_path / "run")).records()[-1].epsilon["p00"]
    restore(tmp_path, nodes[0], backup)
    if resumed:
        coordinator = Coordinator.resume(
            coordinator.config, transport=network.coordinator, store=Store(tmp_path / "run")
        )
    with pytest.raises(PrivacyBudgetRolledBack) as caught:
        coordinator.run(1)
    assert f"epsilon {seen:.4g} spent before, {seen:.4g} claimed" in str(caught.value)
    assert committed < seen  # the committed figure alone let the claim through
    assert len(Ledger(Store(tmp_path / "run")).records()) == 1  # nothing more committed


@pytest.mark.parametrize("resumed", [False, True], ids=["same-coordinator", "resumed"])
def test_an_honest_node_admitted_in_an_aborted_attempt_releases_again(
    tmp_path: Path, resumed: bool
) -> None:
    """No false alarm: a participant whose update an aborted attempt admitted releases
    again in the retry, and its epsilon only grows."""
    coordinator, network, _, _ = aborted_with_admitted(tmp_path)
    if resumed:
        coordinator = Coordinator.resume(
            coordinator.config, transport=network.coordinator, store=Store(tmp_path / "run")
        )
    coordinator.run(1)
    store = Store(tmp_path / "run")
    record = Ledger(store).records()[-1]
    assert record.round == 2 and "p00" in record.contributors
    assert record.epsilon["p00"] > RunManifest.entry(store, 2, 1).epsilon["p00"]


def test_the_largest_figure_seen_counts_not_the_newest_committed() -> None:
    """A claim below what an aborted attempt admitted, though above the ledger's last
    figure, is refused; the figures fold by their largest, whichever comes first."""
    committed = [_record({"p01": 1.0})]
    aborted = [_entry({"p01": 2.5}), _entry({"p01": 1.5, "p02": 0.7})]
    spent = SpentBudgets(lambda: committed, lambda: aborted)
    assert spent.before("p01") == 2.5 and spent.before("p02") == 0.7
    with pytest.raises(PrivacyBudgetRolledBack, match=r"epsilon 2\.5 spent before, 2 claimed"):
        check_spent(spent.before("p01"), update(2.0))  # > 1.0 committed, < 2.5 seen
    check_spent(spent.before("p01"), update(2.6))
    spent.ended(_entry({"p01": 3.0}))
    assert spent.before("p01") == 3.0
    spent.committed(_record({"p01": 2.9}))  # a smaller figure does not lower it
    assert spent.before("p01") == 3.0
    assert SpentBudgets(lambda: committed).before("p01") == 1.0  # the ledger alone


def _record(epsilon: dict[str, float]) -> ContributionRecord:
    """A ledger record holding only ``epsilon`` (all the figures read of a record)."""
    return ContributionRecord.model_construct(epsilon=epsilon)


def _entry(epsilon: dict[str, float]) -> RoundEntry:
    """An aborted attempt's manifest entry whose admitted updates claimed ``epsilon``."""
    return RoundEntry(
        round=2, attempt=1, state=RoundState.ABORTED, round_seed=0, prior_global_hash="",
        epsilon=epsilon,
    )  # fmt: skip
