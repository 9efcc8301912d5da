"""The privacy charge as chain state: PrivacyState's state_dict round trip, the loads it
refuses, and a participant that exports and imports it with the rest of its state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import small_config

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import RoundError
from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.release.accounting import PrivacyState, check_restored
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.transports.inprocess import InProcessNetwork

GOOD = {
    "accountant": "rdp",
    "adjacency": "substitution",
    "history": [[0.5, 1.0, 3], [1.25, 1.0, 1]],
    "epsilon": 12.5,
}


def test_a_state_dict_round_trips_through_json() -> None:
    state = PrivacyState.load_state_dict(GOOD)
    assert state.history == ((0.5, 1.0, 3), (1.25, 1.0, 1)) and state.epsilon == 12.5
    saved = state.state_dict()
    assert saved == GOOD
    again = PrivacyState.load_state_dict(json.loads(json.dumps(saved)))
    assert again == state and type(again) is PrivacyState
    saved["history"].append([9.0, 1.0, 1])  # a copy: the state does not change
    assert PrivacyState.load_state_dict(state.state_dict()) == state


def test_the_state_of_a_budget_is_what_its_file_holds(tmp_path: Path) -> None:
    budget = PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5, adjacency="zero-out")
    assert PrivacyState.of(budget) == PrivacyState("rdp", "zero-out", (), 0.0)
    epsilon = budget.charge(2.0)
    budget.charge(2.0)
    state = PrivacyState.of(PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5,
                                          adjacency="zero-out"))  # fmt: skip
    assert state.history == ((2.0, 1.0, 2),) and state.epsilon > epsilon
    assert PrivacyState.load_state_dict(state.state_dict()) == state


BAD: list[tuple[str, Any]] = [
    ("not a dict", [1, 2]),
    ("missing key", {k: v for k, v in GOOD.items() if k != "epsilon"}),
    ("extra key", {**GOOD, "sample_rate": 1.0}),
    ("accountant", {**GOOD, "accountant": "gdp"}),
    ("adjacency", {**GOOD, "adjacency": "add-remove"}),
    ("history type", {**GOOD, "history": "0.5,1,3"}),
    ("entry arity", {**GOOD, "history": [[0.5, 1.0]]}),
    ("zero sigma", {**GOOD, "history": [[0.0, 1.0, 1]]}),
    ("nan sigma", {**GOOD, "history": [[float("nan"), 1.0, 1]]}),
    ("inf sigma", {**GOOD, "history": [[float("inf"), 1.0, 1]]}),
    ("text sigma", {**GOOD, "history": [["0.5", 1.0, 1]]}),
    ("zero rate", {**GOOD, "history": [[0.5, 0.0, 1]]}),
    ("rate above one", {**GOOD, "history": [[0.5, 1.5, 1]]}),
    ("zero steps", {**GOOD, "history": [[0.5, 1.0, 0]]}),
    ("float steps", {**GOOD, "history": [[0.5, 1.0, 1.0]]}),
    ("bool steps", {**GOOD, "history": [[0.5, 1.0, True]]}),
    ("negative epsilon", {**GOOD, "epsilon": -1.0}),
    ("nan epsilon", {**GOOD, "epsilon": float("nan")}),
    ("text epsilon", {**GOOD, "epsilon": "12.5"}),
    ("spent without history", {**GOOD, "history": [], "epsilon": 1.0}),
]


@pytest.mark.parametrize(("why", "data"), BAD, ids=[why for why, _ in BAD])
def test_a_bad_state_dict_is_refused(why: str, data: Any) -> None:
    with pytest.raises(RoundError, match="privacy state"):
        PrivacyState.load_state_dict(data)


def test_a_restored_state_of_another_accountant_or_adjacency_is_refused(tmp_path: Path) -> None:
    budget = PrivacyBudget(tmp_path, "p", epsilon=1e9, delta=1e-5)
    state = PrivacyState.load_state_dict(GOOD)
    for sigma, _, steps in state.history:  # the budget file holds what the state spent
        for _ in range(steps):
            budget.charge(sigma, sensitivity_factor=1.0)
    assert check_restored(state, budget) == state and check_restored(None, budget) is None
    for other in (state._replace(accountant="prv"), state._replace(adjacency="zero-out")):
        with pytest.raises(RoundError, match="this stage's budget"):
            check_restored(other, budget)
    with pytest.raises(RoundError, match="not a PrivacyState"):
        check_restored((state.history, state.epsilon), budget)
    with pytest.raises(RoundError, match="history entry 0"):
        check_restored(state._replace(history=((-1.0, 1.0, 1),)), budget)


# -- a participant carries the charge with its state ----------------------------------------
def dp_participant(tmp_path: Path, index: int = 1) -> Participant:
    base = small_config()
    config = LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        privacy={"clip_norm": 0.5, "noise_multiplier": 1.0, "dp_epsilon": 50.0,
                 "dp_state_dir": str(tmp_path / "budgets")},
    )  # fmt: skip
    return Participant(
        config,
        participant_id="p",
        transport=InProcessNetwork().transport_for("p"),
        trainer=ToyTrainer(index),
    )


def global_state(rnd: int) -> GlobalState:
    return GlobalState.create(rnd, initial_params(seed=rnd), sketch_seed=100 + rnd, h_steps=2)


def charge_of(participant: Participant) -> PrivacyState:
    state = participant.pipeline_state.states[2]
    assert type(state) is PrivacyState
    return state


def test_the_charge_travels_with_the_participants_state(tmp_path: Path) -> None:
    first = dp_participant(tmp_path)
    released = first.local_round(global_state(0), 11)
    charged = charge_of(first)
    assert charged.epsilon == released.epsilon and charged.history == ((0.5, 1.0, 1),)
    exported = first.export_state()
    rebuilt = dp_participant(tmp_path)
    rebuilt.import_state(exported)
    assert charge_of(rebuilt) == charged
    rebuilt.local_round(global_state(1), 12)  # charges the same durable budget
    assert charge_of(rebuilt).history == ((0.5, 1.0, 2),)


def tampered(state: PortableState, history: list) -> PortableState:
    meta = json.loads(json.dumps(state.meta))
    node = meta["release"]["state"]["parts"][2]["state"]
    assert node["class"].endswith(":PrivacyState")
    node["items"][2] = {"t": "tuple", "items": [
        {"t": "tuple", "items": [{"t": "float", "v": float(x).hex()} if i < 2
                                 else {"t": "int", "v": str(x)} for i, x in enumerate(entry)]}
        for entry in history
    ]}  # fmt: skip
    return PortableState(arrays=dict(state.arrays), meta=meta)


def test_an_import_with_a_bad_charge_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    donor = dp_participant(tmp_path)
    donor.local_round(global_state(0), 11)
    good = donor.export_state()
    assert tampered(good, [[0.5, 1.0, 1]]).meta == good.meta  # the tampering is faithful
    target = dp_participant(tmp_path, index=2)
    target.local_round(global_state(0), 11)
    target.local_round(global_state(1), 12)
    before = target.export_state()
    with pytest.raises(RoundError, match="privacy state"):
        target.import_state(tampered(good, [[-0.5, 1.0, 1]]))
    after = target.export_state()
    assert after.meta == before.meta
    for name in before.arrays:
        np.testing.assert_array_equal(after.arrays[name], before.arrays[name])
    assert charge_of(target).history == ((0.5, 1.0, 3),)
    target.import_state(good)
    assert charge_of(target).history == ((0.5, 1.0, 1),)


def test_a_state_that_spent_more_than_its_budget_file_records_is_refused(tmp_path: Path) -> None:
    """A budget file lost or rolled back after the participant saved its state: restoring
    the state would let it spend the released budget again."""
    budget = PrivacyBudget(tmp_path / "kept", "p", epsilon=50.0, delta=1e-5)
    budget.charge(2.0)
    older = PrivacyState.of(budget)
    budget.charge(2.0)
    spent = PrivacyState.of(budget)
    assert check_restored(spent, budget) == spent
    assert check_restored(older, budget) == older  # a chain that failed after a charge
    lost = PrivacyBudget(tmp_path / "new", "p", epsilon=50.0, delta=1e-5)
    with pytest.raises(RoundError, match=r"2 releases .* records 0 .* rolled back"):
        check_restored(spent, lost)
    lost.charge(2.0)
    with pytest.raises(RoundError, match="records 1"):
        check_restored(spent, lost)
    assert len(lost.history) == 1 and lost.history[0][2] == 1  # refusing spends nothing


@pytest.mark.parametrize("mechanism", ["gaussian_noise", "distributed_noise"])
def test_either_noise_stage_refuses_a_budget_file_that_lost_its_charge(
    tmp_path: Path, mechanism: str
) -> None:
    """The stage's state is its last charge; a budget file that holds less at the next
    charge (rolled back, deleted) is refused before anything is drawn or recorded."""
    from lensemble_flwr.errors import PrivacyBudgetRolledBack
    from lensemble_flwr.release.noise import distributed_noise, gaussian_noise
    from lensemble_flwr.release.pipeline import Release

    budget = PrivacyBudget(tmp_path, "participant-p", epsilon=500.0, delta=1e-5)
    if mechanism == "gaussian_noise":
        stage = gaussian_noise(1.0, 0.5, budget)
    else:
        stage = distributed_noise(1.0, 0.5, fraction_bits=16, threshold=3, budget=budget)
    clipped = Release(delta={"w": np.full(4, 0.1, np.float32)}, metadata={"clipped_norm": 0.2})
    state = stage.init({})
    _, state = stage.update(clipped, state, None)
    kept = budget.path.read_bytes()
    _, state = stage.update(clipped, state, None)
    budget.path.write_bytes(kept)  # one release rolled back
    with pytest.raises(PrivacyBudgetRolledBack, match="records 1 releases"):
        stage.update(clipped, state, None)
    assert budget.path.read_bytes() == kept
    budget.path.unlink()  # deleted
    with pytest.raises(PrivacyBudgetRolledBack, match="records 0 releases"):
        stage.update(clipped, state, None)
    assert not budget.path.exists()
