"""The noise multiplier from a target budget, and plans refused before round 1."""

from __future__ import annotations

import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from federation_helpers import dp_config, federation, small_config

from lensemble_flwr.config import LensembleConfig, PrivacyConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.calibration import (
    calibrated_noise_multiplier,
    ingress_bound,
    max_rounds,
    noise_multiplier_of,
    planned_epsilon,
    planned_releases,
    releases_of,
)
from lensemble_flwr.provenance.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_the_calibrated_noise_spends_the_budget_and_no_less_noise_would_fit(
    accountant: str,
) -> None:
    sigma = calibrated_noise_multiplier(8.0, 1e-5, 40, accountant)
    assert planned_epsilon(sigma, 40, 1e-5, accountant) <= 8.0
    # the smallest within Opacus's tolerance: 2 % less noise overspends
    assert planned_epsilon(sigma * 0.98, 40, 1e-5, accountant) > 8.0
    if accountant == "rdp":
        assert sigma == pytest.approx(8.07, abs=0.02)  # the figure measured in issue 14


def test_a_plans_epsilon_is_what_the_participants_budget_charges(tmp_path: Path) -> None:
    """An independent recomputation: the budget's own charge, release by release."""
    budget = PrivacyBudget(tmp_path, "p", epsilon=1e9, delta=1e-5)
    for _ in range(3):
        spent = budget.charge(1.3)
    assert planned_epsilon(1.3, 3, 1e-5) == pytest.approx(spent, rel=1e-12)
    assert planned_epsilon(1.0, 1, 1e-5) == pytest.approx(10.73, abs=0.01)


@pytest.mark.parametrize(("sigma", "epsilon"), [(1.0, 20.0), (3.0, 8.0), (8.07, 8.0)])
def test_max_rounds_is_the_last_plan_that_fits(sigma: float, epsilon: float) -> None:
    most = max_rounds(sigma, epsilon, 1e-5)
    assert most >= 1
    assert planned_epsilon(sigma, most, 1e-5) <= epsilon < planned_epsilon(sigma, most + 1, 1e-5)
    assert max_rounds(0.5, 1.0, 1e-5) == 0  # not even one release fits


def test_a_plan_without_a_budget_or_a_clip_is_refused() -> None:
    for privacy in ({"dp_rounds": 10, "clip_norm": 1.0}, {"dp_rounds": 10, "dp_epsilon": 8.0}):
        with pytest.raises(ConfigError, match="dp-rounds plans a dp-epsilon budget"):
            LensembleConfig(privacy=privacy)


def test_a_run_longer_than_its_plan_is_refused_before_round_one(tmp_path: Path) -> None:
    config = dp_config(tmp_path, noise_multiplier=0.0, dp_epsilon=8.0, dp_rounds=2)
    assert config.privacy.calibrated and config.privacy.noised
    with pytest.raises(ConfigError, match="plans 3 rounds but the noise is planned for dp-rou"):
        noise_multiplier_of(config, rounds=3)
    coordinator, _, _ = federation(tmp_path, config=config)
    with pytest.raises(ConfigError, match="dp-rounds"):
        coordinator.run(3)
    assert coordinator.outcomes == []


def test_a_calibrated_federation_spends_its_budget_over_its_plan(tmp_path: Path) -> None:
    config = dp_config(tmp_path, noise_multiplier=0.0, dp_epsilon=40.0, dp_rounds=3)
    coordinator, network, _ = federation(tmp_path, config=config)
    assert coordinator.noise_multiplier == calibrated_noise_multiplier(40.0, 1e-5, 3)
    coordinator.run(3)
    network.flush()
    spent = [e for r in Ledger(coordinator.store).records() for e in r.epsilon.values()]
    final = [e for e in Ledger(coordinator.store).records()[-1].epsilon.values()]
    assert all(e is not None and e <= 40.0 for e in spent)
    assert min(final) > 39.0  # the plan spends (nearly) the whole budget, no more


def test_a_given_noise_that_the_budget_cannot_cover_names_the_way_out() -> None:
    privacy = PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0, dp_epsilon=8.0, dp_rounds=40)
    with pytest.raises(ConfigError) as caught:
        noise_multiplier_of(LensembleConfig(privacy=privacy.model_dump()))
    message = str(caught.value)
    needed = float(re.search(r"noise-multiplier >= ([\d.]+)", message).group(1))
    assert needed == pytest.approx(calibrated_noise_multiplier(8.0, 1e-5, 40), rel=1e-3)
    assert "plan at most 0 rounds" in message  # sigma 1: one release already costs 10.7


def privacy_page_run_configs() -> list[dict]:
    from flwr.common.config import flatten_dict

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Flower depends on tomli there
        import tomli as tomllib

    page = (REPO / "docs" / "privacy.md").read_text()
    return [
        flatten_dict(tomllib.loads(block)["tool"]["flwr"]["app"]["config"])
        for block in re.findall(r"```toml\n(.*?)```", page, re.S)
    ]


@pytest.mark.parametrize("index", range(len(privacy_page_run_configs())))
def test_the_privacy_pages_examples_run_as_written(tmp_path: Path, index: int) -> None:
    """Every run config of docs/privacy.md builds, its noise is the calibrated one the page
    states, and a federation runs its planned rounds within the budget."""
    run_config = privacy_page_run_configs()[index]
    config = LensembleConfig.from_run_config(run_config)
    sigma = noise_multiplier_of(config)
    assert f"calibrated (here {sigma:.2f})" in (REPO / "docs" / "privacy.md").read_text()
    planned = config.privacy.dp_rounds
    base = dp_config(tmp_path)  # the test federation, with the page's settings
    federated = LensembleConfig(
        federation={**base.federation.model_dump(), **config.federation.model_dump(
            include={"secagg_threshold", "min_participants"})},
        inner=base.inner.model_dump(),
        privacy={**config.privacy.model_dump(), "dp_state_dir": str(tmp_path / "budgets")},
    )  # fmt: skip
    # as many participants as the page's quorum (its distributed example has 80)
    nodes = max(4, federated.federation.quorum)
    coordinator, network, _ = federation(tmp_path, config=federated, participants=nodes)
    coordinator.run(planned)
    network.flush()
    final = Ledger(coordinator.store).records()[-1]
    assert final.round == planned
    assert all(e is not None and e <= config.privacy.dp_epsilon for e in final.epsilon.values())
    assert final.privacy is not None and final.privacy.mechanism.startswith(config.privacy.dp_mode)


def test_the_ingress_bound_admits_the_noises_reach(tmp_path: Path) -> None:
    """At epsilon 1 over 20 rounds the calibrated noise puts released values far past the
    default max-abs-update (64): every update used to be rejected at ingress. Under local
    DP the bound is raised to the noise's reach; a bound that cannot fit is refused."""
    config = dp_config(tmp_path, noise_multiplier=0.0, dp_epsilon=1.0, dp_rounds=20)
    sigma = calibrated_noise_multiplier(1.0, 1e-5, 20)
    assert ingress_bound(config) == pytest.approx(0.5 * (1 + 10 * sigma))
    assert ingress_bound(config) > config.aggregation.guarded_bound() == 64.0  # unset
    coordinator, network, _ = federation(tmp_path, config=config)
    coordinator.run(1)
    network.flush()
    assert coordinator.outcomes[-1].count == 4  # nobody's release was rejected
    assert ingress_bound(dp_config(tmp_path, noise_multiplier=0.0)) == 64.0  # clipped only
    tight = LensembleConfig(
        federation={**config.federation.model_dump(), "weighting": "num-examples"},
        privacy=config.privacy.model_dump(),
        aggregation={"max_weight": 2**29, "max_abs_update": 1.0},
    )  # fmt: skip  (weighted by examples: a weight may reach max-weight)
    with pytest.raises(ConfigError, match="does not fit the int64 accumulator"):
        ingress_bound(tight)


def _binomial_tail(rounds: int, rate: Fraction, k: int) -> Fraction:
    """P(Binomial(rounds, rate) > k), exactly (an independent recomputation)."""
    terms = (
        math.comb(rounds, j) * rate**j * (1 - rate) ** (rounds - j)
        for j in range(k + 1, rounds + 1)
    )
    return sum(terms, Fraction(0))


@pytest.mark.parametrize(
    ("rounds", "rate", "overrun"),
    [
        (20, "0.1", 0.01), (40, "0.25", 0.05), (100, "0.01", 0.001), (7, "0.5", 0.3),
        (3, "0.9", 0.5), (1, "0.005", 0.01),
        # tails far below double precision's 1 - P(X <= k) (found in review)
        (20, "0.1", 1e-17), (300, "0.1", 1e-14), (200, "0.5", 1e-13),
    ],
)  # fmt: skip
def test_planned_releases_is_the_binomial_quantile(rounds: int, rate: str, overrun: float) -> None:
    k = planned_releases(rounds, float(rate), overrun)
    assert _binomial_tail(rounds, Fraction(rate), k) <= overrun
    assert k == 0 or _binomial_tail(rounds, Fraction(rate), k - 1) > overrun
    assert planned_releases(rounds, 1.0, overrun) == rounds  # every round: every release


def test_planned_releases_refuses_a_nonsense_plan() -> None:
    for args in ((-1, 0.5, 0.01), (10, 0.0, 0.01), (10, 1.5, 0.01), (10, 0.5, 0.0), (10, 0.5, 1.0)):
        with pytest.raises(ValueError, match="planned_releases needs"):
            planned_releases(*args)


def test_sampling_calibrates_for_the_likely_releases_not_every_round(tmp_path: Path) -> None:
    """Issue 14, item 1: the sampling rate enters the calibration. At q = 0.1 over 20 rounds
    a participant is asked 2 times on average and more than 6 times with probability below
    1 %, so the noise pays for 6 releases, not 20."""
    plan = {"noise_multiplier": 0.0, "dp_epsilon": 8.0, "dp_rounds": 20}
    every = dp_config(tmp_path, **plan)
    base = small_config()
    sampled = LensembleConfig(
        federation={**base.federation.model_dump(), "sample_fraction": 0.1},
        privacy=every.privacy.model_dump(),
    )
    assert releases_of(every, 20) == 20 and releases_of(sampled, 20) == 6
    rare = sampled.model_copy(
        update={"federation": sampled.federation.model_copy(update={"sample_fraction": 0.005})}
    )
    assert planned_releases(1, 0.005, 0.01) == 0
    assert releases_of(rare, 1) == 1  # a plan of 0 likely releases still pays for one
    assert noise_multiplier_of(every) == calibrated_noise_multiplier(8.0, 1e-5, 20)
    assert noise_multiplier_of(sampled) == calibrated_noise_multiplier(8.0, 1e-5, 6)
    assert noise_multiplier_of(sampled) < 0.6 * noise_multiplier_of(every)
    tight = sampled.model_copy(
        update={"privacy": sampled.privacy.model_copy(update={"dp_overrun": 1e-6})}
    )
    assert releases_of(tight, 20) > 6  # a smaller tail plans more releases (more noise)
    # a given noise is checked against the same plan: sigma 3.2 pays for 6 releases, not 20
    given = sampled.model_copy(
        update={"privacy": sampled.privacy.model_copy(update={"noise_multiplier": 3.2})}
    )
    assert noise_multiplier_of(given) == 3.2
    with pytest.raises(ConfigError, match=r"20 rounds at noise-multiplier 3.2 would spend"):
        noise_multiplier_of(every.model_copy(
            update={"privacy": every.privacy.model_copy(update={"noise_multiplier": 3.2})}
        ))  # fmt: skip
    with pytest.raises(ConfigError, match=r"\d+ releases \(20 rounds at sample-fraction 0.1"):
        noise_multiplier_of(tight.model_copy(
            update={"privacy": tight.privacy.model_copy(update={"noise_multiplier": 3.2})}
        ))  # fmt: skip


def test_a_participant_sampled_past_its_plan_refuses_and_the_federation_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a plan of fewer releases than rounds, the participants the sample asks most
    run out of budget: each refuses (its budget holds), and, under sampling, that stops
    nothing. (Without sampling a spent budget still stops the federation:
    tests/release/test_privacy.py trips that.)"""
    base = small_config(sample_fraction=0.5, max_round_attempts=3)
    config = LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        privacy={
            "clip_norm": 0.5, "dp_epsilon": 20.0, "dp_rounds": 8, "dp_overrun": 0.4,
            "dp_state_dir": str(tmp_path / "budgets"),
        },
    )  # fmt: skip
    planned = releases_of(config, 8)
    assert planned < 8
    coordinator, network, _ = federation(tmp_path, participants=10, config=config)
    coordinator.run(8)
    network.flush()
    records = Ledger(coordinator.store).records()
    assert records[-1].round == 8
    spent = [r for r in caplog.records if "has spent its privacy budget" in r.getMessage()]
    assert spent  # somebody was asked past the plan, refused, and stopped nothing
    releases: dict[str, int] = {}
    for record in records:
        for pid, eps in record.epsilon.items():
            assert eps is not None and eps <= 20.0
            releases[pid] = releases.get(pid, 0) + 1
    assert max(releases.values()) <= planned


def test_a_fixed_sample_larger_than_the_plan_assumes_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: at q = 0.1 over 4 nodes the quorum (3) sets the sample, 3 of 4 a round:
    the plan's rate is far below what participants are asked. Warned, once."""
    base = small_config(sample_fraction=0.1)
    config = LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        privacy={
            "clip_norm": 0.5, "dp_epsilon": 200.0, "dp_rounds": 4,
            "dp_state_dir": str(tmp_path / "budgets"),
        },
    )  # fmt: skip
    coordinator, network, _ = federation(tmp_path, participants=4, config=config)
    coordinator.run(2)
    network.flush()
    warned = [r for r in caplog.records if "which the privacy plan assumes" in r.getMessage()]
    assert len(warned) == 1 and "asks 3 of 4" in warned[0].getMessage()
    plain = small_config(sample_fraction=0.1)  # no DP: nothing to warn about
    caplog.clear()
    coordinator, network, _ = federation(tmp_path, participants=4, config=plain, name="plain")
    coordinator.run(1)
    assert not [r for r in caplog.records if "privacy plan" in r.getMessage()]


def test_an_attempt_is_not_opened_ahead_past_the_plan(tmp_path: Path) -> None:
    """``open_attempt`` checks the plan as ``run`` does: a round beyond ``dp-rounds`` is
    refused before anything is sent (the attempt is not even begun)."""
    config = dp_config(tmp_path, noise_multiplier=0.0, dp_epsilon=40.0, dp_rounds=1)
    coordinator, _, _ = federation(tmp_path, config=config)
    coordinator.run(1)
    with pytest.raises(ConfigError, match="plans 2 rounds but the noise is planned for dp-rou"):
        coordinator.open_attempt()
    assert coordinator.attempt is not None and coordinator.attempt.round == 1
    assert [o.round for o in coordinator.outcomes] == [1]
