"""Set-up shared by every test module.

Participants keep private state on their own disk (privacy budgets and commitment
secrets, docs/privacy.md); tests keep it in a temporary directory of the session instead
of the user's data directory. The run-directory fixtures serve the tests that audit,
tamper with and prove against a federated run.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_dir_helpers import copy_run, federated_run

from lensemble_flwr.clients.threads import use_torch_threads

# Everything the session leaves in the temp folder (the run directories of strategies
# given none, the doc snippets' folders, the participants' private state) goes into one
# folder of its own, removed when the session ends: a test run leaves nothing behind.
# pytest's own tmp_path folders and Ray's session folder stay where they were.
_SYSTEM_TMP = tempfile.gettempdir()
multiprocessing.util.get_temp_dir()  # its folder stays there: it removes it at exit, after us
_SESSION_TMP = tempfile.mkdtemp(prefix="lensemble-tests-")
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", _SYSTEM_TMP)
os.environ.setdefault("RAY_TMPDIR", _SYSTEM_TMP)
_TMPDIR = os.environ.get("TMPDIR")
os.environ["TMPDIR"] = _SESSION_TMP  # subprocesses (a ServerApp, a SuperLink) too
tempfile.tempdir = _SESSION_TMP

# Every in-process federation trains all its participants in this process, and the
# session shares its cores with the processes it starts: torch's intra-op threads, one
# per core by default, would only fight each other (lensemble_flwr/clients/threads.py).
use_torch_threads()

if "LENSEMBLE_PRIVACY_DIR" not in os.environ:
    os.environ["LENSEMBLE_PRIVACY_DIR"] = tempfile.mkdtemp(prefix="lensemble-test-state-")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's temp folder (see above), and point at the system's again."""
    tempfile.tempdir = None
    if _TMPDIR is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _TMPDIR
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A federated run (run_dir_helpers.federated_run), made once per test module; never
    modify it: use ``run``."""
    return federated_run(tmp_path_factory.mktemp("federation"))


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the module's federated run, to tamper with."""
    return copy_run(pristine, tmp_path / "run")


@pytest.fixture(autouse=True)
def _loggers_as_they_were() -> Iterator[None]:
    """Flower's and lensemble's logger levels, put back after every test: a benchmark's
    ``main`` run by a test quiets them for its own output, and later tests check the
    lines they log."""
    loggers = [logging.getLogger(name) for name in ("flwr", "lensemble_flwr")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)
