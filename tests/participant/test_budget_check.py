"""A budget spent by earlier runs is found before the participant trains, and the refusal
says where the budget lives and what is left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import dp_config, federation

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import PrivacyBudgetExceeded
from lensemble_flwr.participant.budget_check import check_budget_affords_release
from lensemble_flwr.privacy.calibration import planned_epsilon


def test_a_budget_spent_by_an_earlier_run_is_refused_before_training(tmp_path: Path) -> None:
    budgets = tmp_path / "budgets"
    two, three = (planned_epsilon(1.0, n, 1e-5) for n in (2, 3))
    config = dp_config(budgets, dp_epsilon=(two + three) / 2)  # two releases fit, not three
    first, _, _ = federation(tmp_path, config=config, name="first")
    first.run(2)
    second, _, nodes = federation(tmp_path, config=config, name="second")
    fits: list[str] = []
    for node in nodes:
        fit = node.training.fit

        def counted(*args: Any, _fit: Any = fit, _id: str = node.participant_id, **kw: Any) -> Any:
            fits.append(_id)
            return _fit(*args, **kw)

        node.training.fit = counted  # type: ignore[method-assign]
    with pytest.raises(PrivacyBudgetExceeded) as caught:
        second.run(1)
    assert fits == []  # nobody trained
    message = str(caught.value)
    assert "dp-budget-dir" in message and str(budgets) in message
    assert f"epsilon {two:.4g} of {(two + three) / 2:g} spent by earlier releases (2)" in message
    assert "left" in message and "refused before training" in message


def test_a_distributed_share_is_checked_as_it_is_charged(tmp_path: Path) -> None:
    """The distributed mechanism is charged as the equivalent Gaussian of its threshold's
    shares: a budget too small for one share is refused before training."""
    config = LensembleConfig(
        federation={"min_participants": 3, "secagg_threshold": 3, "weighting": "uniform"},
        privacy={"clip_norm": 1.0, "noise_multiplier": 1.0, "dp_epsilon": 0.5,
                 "dp_mode": "distributed", "dp_state_dir": str(tmp_path)},
    )  # fmt: skip
    params = {"w": np.zeros(100, np.float32)}
    with pytest.raises(PrivacyBudgetExceeded, match=r"epsilon 0 of 0\.5 spent"):
        check_budget_affords_release(config, "p00", params)
    roomy = LensembleConfig.from_flat({**config.to_flat(), "dp-epsilon": 50.0})
    check_budget_affords_release(roomy, "p00", params)  # fits: nothing raised
    assert not list(tmp_path.glob("*.json"))  # and nothing was charged either way


def test_a_custom_release_chain_is_not_looked_at_before_training(tmp_path: Path) -> None:
    """A participant given its own chain keeps its budget its own way: no look (its noise
    stage, if any, still charges at the release); the default chain's budget is."""
    from lensemble_flwr.participant.budget_check import budget_refusal

    config = dp_config(tmp_path, dp_epsilon=0.01)  # one release would not fit
    params = {"w": np.zeros(4, np.float32)}
    assert budget_refusal(config, None, params) is None
    assert isinstance(budget_refusal(config, "p00", params), PrivacyBudgetExceeded)
