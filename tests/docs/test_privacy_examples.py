"""Every private run config of docs/privacy.md, run as written on the digits app
(apps/digits/pyproject.toml with the example's keys over it), in process: one whose
privacy plan forecasts that the model learns does learn, beating chance by the margin the
page states; one that forecasts it cannot is warned about before round 1."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.privacy.plan import privacy_plan, shared_dim
from lensemble_flwr.simulations.digits_data import initial_params
from lensemble_flwr.simulations.digits_inprocess import run_digits, with_budget_dir
from tests.docs.test_doc_snippets import private_run_configs

REPO = Path(__file__).resolve().parents[2]
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
    found = re.findall(r"beats chance \(0\.1\)\s+by\s+at\s+least\s+([0-9.]+)", PAGE.read_text())
    assert found, "privacy.md states no margin over chance"
    return float(found[0])


EXAMPLES = [(w, c) for w, c in private_run_configs() if w.startswith("privacy.md")]


def test_some_example_of_the_page_learns_on_the_digits_app() -> None:
    learning = [w for w, c in EXAMPLES if _plan(c)[1].learns]
    assert learning, "no privacy.md example is forecast to learn on the digits app"


def _plan(example: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    run_config = {**digits_app_config(), **example}
    config = LensembleConfig.from_run_config(run_config)
    nodes = int(run_config["num-partitions"])
    plan = privacy_plan(
        config,
        rounds=int(run_config["num-server-rounds"]),
        participants=config.federation.sample_size(nodes),
        dim=shared_dim(initial_params(), config),
    )
    assert plan is not None
    return run_config, plan


@pytest.mark.parametrize(("where", "example"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_each_example_learns_on_the_digits_app_or_is_warned_about_before_round_1(
    where: str, example: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_config, plan = _plan(example)
    config = with_budget_dir(LensembleConfig.from_run_config(run_config), tmp_path / "budgets")
    nodes = int(run_config["num-partitions"])
    if plan.learns:
        rounds = int(run_config["num-server-rounds"])
        accuracy = run_digits(config, tmp_path / "run", rounds=rounds, num_partitions=nodes)
        assert accuracy[-1] >= CHANCE + stated_margin(), (where, accuracy)
        return
    with caplog.at_level(logging.INFO):
        run_digits(config, tmp_path / "run", rounds=1, num_partitions=nodes)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    warned = [i for i, (level, m) in enumerate(messages)
              if level == logging.WARNING and "not expected to learn" in m]  # fmt: skip
    first_round = next(i for i, (_, m) in enumerate(messages) if "bound to dataset root" in m)
    assert warned and warned[0] < first_round, where
