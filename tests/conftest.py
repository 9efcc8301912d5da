"""Set-up shared by every test module.

Participants keep private state on their own disk (privacy budgets and commitment
secrets, docs/privacy.md); tests keep it in a temporary directory of the session instead
of the user's data directory. The run-directory fixtures serve the tests that audit,
tamper with and prove against a federated run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from run_dir_helpers import copy_run, federated_run

if "LENSEMBLE_PRIVACY_DIR" not in os.environ:
    os.environ["LENSEMBLE_PRIVACY_DIR"] = tempfile.mkdtemp(prefix="lensemble-test-state-")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A federated run (run_dir_helpers.federated_run), made once per test module; never
    modify it: use ``run``."""
    return federated_run(tmp_path_factory.mktemp("federation"))


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the module's federated run, to tamper with."""
    return copy_run(pristine, tmp_path / "run")
