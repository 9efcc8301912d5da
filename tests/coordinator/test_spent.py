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
from lensemble_flwr.coordinator.spent import SpentBudgets, check_spent
from lensemble_flwr.errors import (
    ForgedMessage,
    PrivacyBudgetExceeded,
    PrivacyBudgetRolledBack,
    response_to,
)
from lensemble_flwr.identity.signing import IdentityKey, verify_signature
from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.participant.release_chain import release_pipeline
from lensemble_flwr.protocol.messages import MessageKind, Update
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
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
