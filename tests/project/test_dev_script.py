"""``./dev.sh main`` checks the run config before it starts anything, and decides the run's
status from ``flwr ls --format json``: the newest run (by ``pending-at``), its details when
it failed, exit code 1 unless it completed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEV_SH = Path(__file__).resolve().parents[2] / "dev.sh"


def _status_program() -> str:
    """The Python program dev.sh pipes ``flwr ls --format json`` into."""
    text = DEV_SH.read_text()
    match = re.search(r"flwr\" ls --format json \| \"\$VENV/bin/python\" -c '(.*?)'\n", text, re.S)
    assert match, "dev.sh no longer reads the run status this way"
    return match.group(1)


def _run(runs: list[dict]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _status_program()],
        input=json.dumps({"runs": runs}),
        capture_output=True,
        text=True,
        check=False,
    )


def _row(run_id: str, status: str, pending: str, details: str = "N/A") -> dict:
    return {"run-id": run_id, "status": status, "status-details": details, "pending-at": pending}


@pytest.mark.parametrize(
    ("runs", "printed", "code"),
    [
        # flwr ls lists the newest first: the newest is the one this script started
        (
            [
                _row("2", "finished:failed", "2026-12-05 14:40:02", "ConfigError: x"),
                _row("1", "finished:completed", "2026-12-05 14:10:00"),
            ],
            "run status: finished:failed (ConfigError: x)",
            1,
        ),
        (
            [
                _row("1", "finished:failed", "2026-12-05 14:10:00", "old"),
                _row("2", "finished:completed", "2026-12-05 14:40:02"),
            ],
            "run status: finished:completed",
            0,
        ),
        ([], "run status: no run", 1),
    ],
)
def test_dev_sh_reports_the_newest_runs_status(runs: list[dict], printed: str, code: int) -> None:
    done = _run(runs)
    assert done.stdout.strip() == printed, done.stderr
    assert done.returncode == code


def test_dev_sh_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(DEV_SH)], check=False).returncode == 0


def test_dev_sh_main_stops_on_a_bad_run_config_before_starting_anything(tmp_path: Path) -> None:
    """``./dev.sh main --run-config ...`` checks the run config first: a typo is named
    with the key it meant, in about a second, and no SuperLink or ``flwr`` is started.
    (A virtualenv of shims: this interpreter as its python, Flower's commands recording
    that they ran.)"""
    repo = DEV_SH.parent
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    digest = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".lensemble-installed").write_text(digest)  # setup() has nothing to do
    started = tmp_path / "started"
    shims = {"python": f'exec {sys.executable} "$@"'}
    for name in ("flower-superlink", "flwr"):
        shims[name] = f"echo {name} >> {started}; exit 1"
    for name, body in shims.items():
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    env = {
        **os.environ,
        "LENSEMBLE_VENV": str(venv),
        "PYTHONPATH": str(repo),  # this tree's package
        "TMPDIR": str(tmp_path),  # dev.sh's Flower home
        "APP": "apps/digits",
    }
    done = subprocess.run(
        ["bash", str(DEV_SH), "main", "--stream", "--run-config", "lensemble.outer_lr=0.5"],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "lensemble.outer_lr: not a key of this app's" in done.stderr
    assert "did you mean 'lensemble.outer-lr'?" in done.stderr
    assert not started.exists()
