"""``./dev.sh main`` decides the run's status from ``flwr ls --format json``: the newest run
(by ``pending-at``), its details when it failed, exit code 1 unless it completed."""

from __future__ import annotations

import json
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
