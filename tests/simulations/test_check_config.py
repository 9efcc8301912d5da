"""check_config.py: a Flower App's run config checked before any engine starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.simulations.check_config import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    check_run_config,
    main,
    run_config_args_of,
)

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "apps" / "digits"

APP = """
[project]
name = "fl-dp-sa-like"
version = "1.0.0"

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "x:server"
clientapp = "x:client"

[tool.flwr.app.config]
num-server-rounds = 3
noise-multiplier = 0.5      # the app's own (its DP wrapper's)

[tool.flwr.app.config.lensemble]
noise-multiplier = 0.0
outer-lr = 0.7
"""


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text(APP)
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_a_typo_in_a_lensemble_key_is_named_with_the_key_it_meant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run(capsys, str(DIGITS), "--run-config", "lensemble.outer_lr=0.5")
    assert code == EXIT_FAILED
    assert err.startswith("check-config: lensemble.outer_lr: not a key of this app's")
    assert "did you mean 'lensemble.outer-lr'?" in err
    assert "nothing was started" in err


def test_a_negative_value_names_the_key_and_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run(capsys, str(DIGITS), "-c", "lensemble.collect-timeout=-5")
    assert code == EXIT_FAILED
    assert "check-config: lensemble.collect-timeout: Input should be greater than 0 (got -5)" in err


def test_a_dp_plan_that_the_run_outlasts_or_the_budget_cannot_pay_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dp = "lensemble.clip-norm=1.0 lensemble.dp-epsilon=8.0"
    code, err = run(capsys, str(DIGITS), "-c", f"num-server-rounds=6 {dp} lensemble.dp-rounds=5")
    assert code == EXIT_FAILED
    assert "check-config: dp-rounds: the run plans 6 rounds but the noise is planned" in err
    cheap = "lensemble.noise-multiplier=0.5"  # 5 rounds of it cost far more than epsilon 8
    code, err = run(capsys, str(DIGITS), "-c", f"num-server-rounds=5 {dp} {cheap}")
    assert code == EXIT_FAILED and "would spend epsilon" in err
    code, _ = run(capsys, str(DIGITS), "-c", f"num-server-rounds=5 {dp} lensemble.dp-rounds=5")
    assert code == EXIT_OK  # a plan that fits passes


def test_an_unknown_app_key_is_named_with_the_declared_key_it_meant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run(capsys, str(DIGITS), "-c", "num-server-round=3")
    assert code == EXIT_FAILED
    assert "num-server-round: not a key of this app's [tool.flwr.app.config]" in err
    assert "did you mean 'num-server-rounds'?" in err


def test_a_lensemble_key_the_app_does_not_declare_says_to_declare_it(
    app: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(capsys, str(app), "-c", "lensemble.inner-lr=0.01")
    assert code == EXIT_FAILED
    assert "lensemble.inner-lr: a lensemble key this app does not declare: add 'inner-lr'" in err


def test_every_problem_is_listed_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, str(DIGITS), "-c", "num-server-round=3 lensemble.inner-lr=0")
    assert code == EXIT_FAILED
    assert "num-server-round:" in err and "lensemble.inner-lr: Input should be greater" in err


def test_a_good_run_config_passes_quietly_and_fast(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code, err = run(capsys, str(DIGITS), "-c", "lensemble.outer-lr=0.5 num-server-rounds=2")
    assert time.perf_counter() - started < 0.5  # the check; the imports are the rest
    assert (code, err) == (EXIT_OK, "")
    check = check_run_config(DIGITS, ["lensemble.outer-lr=0.5", "num-server-rounds=2"])
    assert check.ok and check.run_config["lensemble.outer-lr"] == 0.5
    assert check.run_config["num-server-rounds"] == 2
    assert check.run_config["lensemble.min-participants"] == 8  # the app's own default
    assert run(capsys, str(DIGITS)) == (EXIT_OK, "")  # no overrides: the pyproject alone


def test_the_app_key_of_a_lensemble_name_is_left_alone_and_noted(
    app: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fl-dp-sa declares its own noise-multiplier: it is not lensemble's, whatever its
    value; only lensemble.noise-multiplier is."""
    check = check_run_config(app, ["noise-multiplier=2.5 lensemble.noise-multiplier=0"])
    assert check.ok, check.errors
    assert LensembleConfig.from_run_config(check.run_config).privacy.noise_multiplier == 0
    code, err = run(capsys, str(app), "-c", "noise-multiplier=-1")  # not lensemble's to judge
    assert code == EXIT_OK
    assert "note: noise-multiplier: the app's own key; lensemble reads " in err
    assert "lensemble.noise-multiplier (= 0.0)" in err


def test_a_run_config_flower_cannot_parse_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, str(DIGITS), "-c", "lensemble.outer-lr==")
    assert code == EXIT_FAILED
    assert "check-config: --run-config: The provided configuration string is in an invalid" in err


def test_a_folder_without_an_app_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(capsys, str(tmp_path))
    assert code == EXIT_USAGE
    assert "Cannot find pyproject.toml" in err


def test_the_run_config_values_are_found_among_flwr_runs_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--stream", "--federation-config", "num-supernodes=3", "-c", "a=1",
            "--run-config", "b=2", "--run-config=c=3", "-cd=4"]  # fmt: skip
    assert run_config_args_of(args) == ["a=1", "b=2", "c=3", "d=4"]
    code, err = run(
        capsys, str(DIGITS), "--flwr-run-args", "--stream", "--federation-config",
        "num-supernodes=3", "--run-config", "lensemble.outer_lr=0.5",
    )  # fmt: skip
    assert code == EXIT_FAILED and "lensemble.outer_lr: not a key" in err


def test_python_dash_m_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lensemble_flwr.simulations.check_config", str(DIGITS),
         "-c", "lensemble.outer_lr=0.5"],
        capture_output=True, text=True, check=False, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == EXIT_FAILED
    assert "did you mean 'lensemble.outer-lr'?" in done.stderr


def test_an_override_flower_would_drop_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """Flower merges --run-config values table by table: a second value with a lensemble
    key replaces the lensemble keys of the first, silently."""
    code, err = run(
        capsys, str(DIGITS), "-c", "lensemble.outer-lr=0.5", "-c", "lensemble.inner-lr=0.1"
    )
    assert code == EXIT_FAILED
    assert "check-config: lensemble.outer-lr: Flower drops this override" in err
    assert "lensemble.inner-lr" not in err
    together = check_run_config(DIGITS, ["lensemble.outer-lr=0.5 lensemble.inner-lr=0.1"])
    assert together.ok and together.run_config["lensemble.outer-lr"] == 0.5
    apart = check_run_config(DIGITS, ["num-server-rounds=2", "lensemble.inner-lr=0.1"])
    assert apart.ok and apart.run_config["num-server-rounds"] == 2  # other tables are kept


def test_a_check_across_lensemble_keys_is_said_without_the_whole_section(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run(capsys, str(DIGITS), "-c", "lensemble.noise-multiplier=1.0")
    assert code == EXIT_FAILED
    assert "PrivacyConfig: noise-multiplier > 0 needs clip-norm > 0 (noise is calibrated" in err
    assert "got {" not in err


def test_a_typo_in_the_apps_own_lensemble_table_is_found_without_overrides(
    app: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flower takes it (the app declares it), and the ServerApp stopped on it only after
    the engine's start-up: the check names it before."""
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("outer-lr = 0.7", "outer_lr = 0.7"))
    code, err = run(capsys, str(app))
    assert code == EXIT_FAILED
    assert (
        "check-config: lensemble.outer_lr: unknown lensemble run_config key; "
        "did you mean 'lensemble.outer-lr'?"
    ) in err
