"""lensemble's warnings show as Flower's lines during a run when nothing configured
logging, and a logging configuration of the user's own is left alone. Each case runs in
a fresh interpreter: pytest itself puts handlers on the root logger."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import logging
{configure}
from lensemble_flwr.strategies.flower_logs import lensemble_logs_through_flower
log = logging.getLogger("lensemble_flwr.coordinator.coordinator")
with lensemble_logs_through_flower():
    log.warning("inside the run")
    log.info("not shown: lensemble's INFO lines stay its own")
log.warning("after the run")
print("handlers after:", logging.getLogger("lensemble_flwr").handlers)
"""


def _run(configure: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(configure=configure)],
        capture_output=True,
        text=True,
        check=True,
        env={"FLWR_TELEMETRY_ENABLED": "0", "PATH": ""},
    )
    return done.stdout, done.stderr


def test_a_warning_in_a_run_is_one_of_flowers_lines() -> None:
    out, err = _run("")
    inside = [line for line in err.splitlines() if "inside the run" in line]
    assert len(inside) == 1 and "WARNING" in inside[0]  # with its level, as Flower prints
    assert "not shown" not in err
    assert "\nafter the run" in "\n" + err  # afterwards: Python's last resort, as before
    assert "handlers after: []" in out  # nothing left behind


@pytest.mark.parametrize(
    ("configure", "handlers_after"),
    [
        ("logging.basicConfig(format='ROOT %(levelname)s %(message)s')", "[]"),
        (
            "logging.getLogger('lensemble_flwr').addHandler(logging.StreamHandler())",
            "[<StreamHandler <stderr> (NOTSET)>]",  # the user's own, and only it
        ),
    ],
)
def test_a_users_logging_configuration_is_left_alone(configure: str, handlers_after: str) -> None:
    out, err = _run(configure)
    assert err.count("inside the run") == 1  # printed once, by the user's handler only
    assert f"handlers after: {handlers_after}" in out
    if "basicConfig" in configure:
        assert "ROOT WARNING inside the run" in err
