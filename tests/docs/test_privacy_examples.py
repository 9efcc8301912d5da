"""Every private run config of docs/privacy.md, run as written on the digits app
(apps/digits/pyproject.toml with the example's keys over it), in process. Each is
forecast to learn by its privacy plan and does, beating chance by the margin the page
states. The page's first example with dp-mode "local", which the page says the plan
warns about, is warned about before round 1."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.privacy.plan import privacy_plan, shared_dim
from lensemble_flwr.simulations.digits_data import initial_params, model_class_of
from lensemble_flwr.simulations.digits_inprocess import run_digits, with_budget_dir
from tests.docs.test_doc_snippets import private_run_configs

REPO = Path(__file__).resolve().parents[2]
NOISE_SEED = 0


@pytest.fixture(autouse=True)
def _repeatable_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise is fresh in every real run, by design (privacy/gaussian.py keys its
    ChaCha20 stream from os.urandom): here it is keyed from a seeded stream instead, so
    that each example is the same run every time the test runs: one draw of the noise,
    not the best of several, which a change in how many bytes are drawn, or in what
    order, replaces by another draw. The page's figures are fresh-noise runs."""
    import random
    from types import SimpleNamespace

    from lensemble_flwr.privacy import gaussian

    draws = random.Random(NOISE_SEED)
    monkeypatch.setattr(gaussian, "os", SimpleNamespace(urandom=draws.randbytes))
PAGE = REPO / "docs" / "privacy.md"
CHANCE = 0.1  # ten digits


def digits_app_config() -> dict[str, Any]:
    """The digits app's run config, flattened as Flower flattens it."""
    from flwr.common.config import flatten_dict

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Flower depends on tomli there
        import tomli as tomllib

    app = tomllib.loads((REPO / "apps" / "digits" / "pyproject.toml").read_text())
    return dict(flatten_dict(app["tool"]["flwr"]["app"]["config"]))


def stated_margin() -> float:
    """The margin over chance privacy.md promises a learning example."""
    found = re.findall(
        r"beats chance \(0\.1\)\s+by\s+at\s+least\s+([0-9]+(?:\.[0-9]+)?)", PAGE.read_text()
    )
    assert found, "privacy.md states no margin over chance"
    return float(found[0])


EXAMPLES = [(w, c) for w, c in private_run_configs() if w.startswith("privacy.md")]
LEARNING = EXAMPLES
# privacy.md: "The same run with `dp-mode = "local"` is warned about, before round 1"
(FIRST_WHERE, FIRST), *_ = EXAMPLES
NOT_LEARNING = [(f"{FIRST_WHERE} with dp-mode local", {**FIRST, "lensemble.dp-mode": "local"})]


def test_the_page_opens_with_a_learning_example_and_says_which_variant_is_warned() -> None:
    page = PAGE.read_text()
    first_example = page.index("```toml")
    assert FIRST["lensemble.dp-mode"] == "distributed"
    assert first_example < page.index('The same run with `dp-mode = "local"` is warned about')
    assert len(LEARNING) == 3  # distributed (the first), zero-out, sampling
    assert "distributed DP, ε = 8 (the first)" in page


def _plan(example: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    run_config = {**digits_app_config(), **example}
    config = LensembleConfig.from_run_config(run_config)
    nodes = int(run_config["num-partitions"])
    plan = privacy_plan(
        config,
        rounds=int(run_config["num-server-rounds"]),
        participants=config.federation.sample_size(nodes),
        dim=shared_dim(initial_params(model_class=model_class_of(run_config["model"])), config),
    )
    assert plan is not None
    return run_config, plan


@pytest.mark.parametrize(("where", "example"), LEARNING, ids=[w for w, _ in LEARNING])
def test_each_example_learns_on_the_digits_app_as_written(
    where: str, example: dict[str, Any], tmp_path: Path
) -> None:
    run_config, plan = _plan(example)
    assert plan.learns, (where, plan.noise_to_signal)  # not drowned, by the forecast
    config = with_budget_dir(LensembleConfig.from_run_config(run_config), tmp_path / "budgets")
    accuracy = run_digits(
        config,
        tmp_path / "run",
        rounds=int(run_config["num-server-rounds"]),
        num_partitions=int(run_config["num-partitions"]),
        data_seed=int(run_config["data-seed"]),
        model_class=model_class_of(run_config["model"]),
    )
    assert accuracy[-1] >= CHANCE + stated_margin(), (where, accuracy)


@pytest.mark.parametrize(("where", "example"), NOT_LEARNING, ids=[w for w, _ in NOT_LEARNING])
def test_the_example_that_does_not_learn_is_warned_about_before_round_1(
    where: str, example: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_config, plan = _plan(example)
    assert not plan.learns, (where, plan.noise_to_signal)
    config = with_budget_dir(LensembleConfig.from_run_config(run_config), tmp_path / "budgets")
    with caplog.at_level(logging.INFO):
        run_digits(
            config, tmp_path / "run", rounds=1, num_partitions=int(run_config["num-partitions"]),
            model_class=model_class_of(run_config["model"]),
        )  # fmt: skip
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    warned = [i for i, (level, m) in enumerate(messages)
              if level == logging.WARNING and "not expected to learn" in m]  # fmt: skip
    first_round = next(i for i, (_, m) in enumerate(messages) if "bound to dataset root" in m)
    assert warned and warned[0] < first_round, where
