"""The privacy plan said before round 1, and its forecast of the noise on the mean."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import dp_config, federation

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.plan import LEARNS_BELOW, privacy_plan, shared_dim


def _config(**privacy: object) -> LensembleConfig:
    fed: dict[str, object] = {"min_participants": 3}
    if privacy.get("dp_mode") == "distributed":
        fed |= {"secagg_threshold": 3, "weighting": "uniform"}
    return LensembleConfig(
        federation=fed,
        privacy={"clip_norm": 1.0, "dp_epsilon": 8.0, "dp_rounds": 40, **privacy},
    )


def test_no_noise_has_no_plan() -> None:
    assert privacy_plan(LensembleConfig(), rounds=5, participants=10, dim=100) is None


def test_the_local_forecast_is_the_norm_of_the_noise_on_a_uniform_mean() -> None:
    """sigma*sqrt(P/N): measured on N releases of N(0, (sigma C)^2) per coordinate, as the
    local noise stage adds them, averaged uniformly."""
    plan = privacy_plan(_config(noise_multiplier=0.5, dp_rounds=0, dp_epsilon=1e6),
                        rounds=3, participants=10, dim=2000)  # fmt: skip
    assert plan is not None
    rng = np.random.default_rng(0)
    norms = [
        np.linalg.norm(rng.normal(0.0, 0.5 * 1.0, (10, 2000)).mean(axis=0)) for _ in range(50)
    ]
    assert plan.noise_to_signal == pytest.approx(0.5 * math.sqrt(2000 / 10))
    assert float(np.mean(norms)) == pytest.approx(plan.noise_to_signal, rel=0.03)


def test_the_distributed_forecast_counts_the_shares_of_n_members() -> None:
    """Each share carries sigma C / sqrt(t) per coordinate, so that t of them carry sigma C;
    the mean of N members' sum carries sigma C sqrt(N/t) / N."""
    plan = privacy_plan(_config(dp_mode="distributed"), rounds=40, participants=12, dim=900)
    assert plan is not None and plan.threshold == 3
    share = plan.noise_multiplier / math.sqrt(3)
    rng = np.random.default_rng(1)
    norms = [np.linalg.norm(rng.normal(0.0, share, (12, 900)).sum(axis=0) / 12) for _ in range(50)]
    assert float(np.mean(norms)) == pytest.approx(plan.noise_to_signal, rel=0.03)


def test_a_plan_that_cannot_learn_warns_naming_what_would_fix_it() -> None:
    """Local DP at epsilon 8 over 40 rounds on the 10-node digits app (2,410 parameters):
    noise 125 times the clip norm on the mean (sigma 8.07)."""
    plan = privacy_plan(_config(), rounds=5, participants=10, dim=2410)
    assert plan is not None
    assert plan.noise_multiplier == pytest.approx(8.07, abs=0.02)
    assert plan.noise_to_signal == pytest.approx(125, rel=0.01)
    assert not plan.learns
    warning = plan.warning()
    assert warning is not None
    for fix in ("distributed DP", "more participants", "fewer rounds or a larger epsilon"):
        assert fix in warning
    lines = "\n".join(plan.lines())
    for shown in ("local Gaussian", "noise multiplier 8.066", "clip norm 1", "epsilon 8",
                  "delta 1e-05", "40 rounds", "accountant rdp", "substitution adjacency",
                  "125 x the clip norm",
                  "outer step: lr 0.7, momentum 0.5 (the default under DP"):  # fmt: skip
        assert shown in lines
    explicit = privacy_plan(
        LensembleConfig.from_flat({**_config().to_flat(), "outer-momentum": 0.9}),
        rounds=5, participants=10, dim=2410,
    )  # fmt: skip
    assert explicit is not None
    assert "momentum 0.9 (as set; the default under DP is lr 0.7, momentum 0.5)" in "\n".join(
        explicit.lines()
    )


def test_a_plan_under_the_threshold_says_nothing_more() -> None:
    plan = privacy_plan(_config(noise_multiplier=0.1, dp_rounds=0, dp_epsilon=1e6),
                        rounds=3, participants=100, dim=650)  # fmt: skip
    assert plan is not None and plan.noise_to_signal < LEARNS_BELOW
    assert plan.learns and plan.warning() is None


def test_a_plan_the_budget_cannot_cover_is_refused_as_before() -> None:
    with pytest.raises(ConfigError, match="dp-rounds"):
        privacy_plan(_config(), rounds=41, participants=10, dim=10)


def test_the_shared_dimension_leaves_local_groups_and_integers_out() -> None:
    config = LensembleConfig(groups={"shared": "*", "local": "head"})
    params = {
        "body.w": np.zeros((3, 4), np.float32),
        "head.w": np.zeros(5, np.float32),
        "steps": np.zeros(2, np.int64),
    }
    assert shared_dim(params, config) == 12


def test_an_in_process_run_logs_the_plan_and_the_warning_before_round_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = dp_config(tmp_path / "budgets", noise_multiplier=50.0, dp_epsilon=1e7)
    coordinator, _network, _nodes = federation(tmp_path, config=config)
    with caplog.at_level(logging.INFO):
        coordinator.run(1)
    messages = [r.getMessage() for r in caplog.records]
    plan = next(i for i, m in enumerate(messages) if m.startswith("privacy plan:"))
    warned = next(i for i, m in enumerate(messages) if "not expected to learn" in m)
    # round 1's first message: a participant's commitment to its data
    first_round = next(i for i, m in enumerate(messages) if "bound to dataset root" in m)
    assert plan < warned < first_round
    assert caplog.records[warned].levelno == logging.WARNING
    assert sum(m.startswith("privacy plan:") for m in messages) == 1
