"""The Flower Apps of the repository are valid apps whose run configs the apps accept."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict, validate_config

from lensemble_flwr.config import NAMESPACE, LensembleConfig, run_config_keys
from lensemble_flwr.simulations import digits, lm, world

if sys.version_info >= (3, 11):
    import tomllib
else:  # Flower depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("app_dir", "module"),
    [(REPO, world), (REPO / "apps" / "digits", digits), (REPO / "apps" / "lm", lm)],
    ids=["world (default)", "digits", "lm"],
)
def test_the_app_is_valid_and_its_run_config_loads(app_dir: Path, module) -> None:
    config = tomllib.loads((app_dir / "pyproject.toml").read_text())
    ok, errors, _warnings = validate_config(config, check_module=True, project_dir=app_dir)
    assert ok, errors
    components = config["tool"]["flwr"]["app"]["components"]
    assert components["serverapp"] == f"{module.__name__}:server_app"
    run_config = flatten_dict(config["tool"]["flwr"]["app"]["config"])
    # Flower refuses a --run-config override of a key the app does not declare
    assert {NAMESPACE + key for key in run_config_keys()} <= set(run_config)
    loaded = LensembleConfig.from_run_config(run_config)
    if module is world:
        world.check_groups(loaded)  # the action heads stay local
        assert loaded.gauge.align
    if module is lm:
        lm.check_app_keys(run_config)  # the app's own keys: the split, the model
