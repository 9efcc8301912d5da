"""A benchmark's own ``FLWR_HOME``, made only when the environment names none.

Flower writes under ``FLWR_HOME`` (``~/.flwr`` when it is unset). A benchmark run by hand
gets a temporary folder of its own, removed when the process exits; a benchmark whose
environment already names one (a test, a parent benchmark, the user) uses that folder and
makes nothing. Call it before ``flwr`` is imported."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def use_own_flwr_home(prefix: str) -> str | None:
    """Set Flower's quiet defaults and, unless ``FLWR_HOME`` is set, point it at a new
    temporary folder removed at exit. The folder made, or None if none was."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    if os.environ.get("FLWR_HOME"):
        return None
    home = tempfile.mkdtemp(prefix=prefix)
    os.environ["FLWR_HOME"] = home
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return home
