"""What every ``lensemble-flwr`` command shares: exit codes, the usage error, consoles, atomic
writes."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

PIPE_WIDTH = 160

EXIT_OK = 0
EXIT_FAILED = 1
"""A check failed: a broken link in the run, a proof that does not verify."""
EXIT_USAGE = 2
"""The command could not run: bad arguments, a path that is not a run directory."""


class UsageError(Exception):
    """Arguments that name nothing usable (reported with exit code ``EXIT_USAGE``)."""


def stdout() -> Console:
    """The console for results. Text is never parsed as markup (a run's strings are data),
    nothing is highlighted, and long lines are not folded. Piped output gets
    ``PIPE_WIDTH`` columns for tables (a terminal's own width otherwise; ``COLUMNS`` wins)."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(
        markup=False, highlight=False, soft_wrap=True, width=PIPE_WIDTH if piped else None
    )


def stderr() -> Console:
    """The console for progress and errors."""
    return Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on stderr while a slow step runs, only when stderr is a terminal."""
    console = stderr()
    if not sys.stderr.isatty():
        yield
        return
    with console.status(message):
        yield


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``:
    ``path`` holds the old bytes or the new ones, never part of either. The file gets the
    mode any new file of the user gets (the umask's, not the temp file's 0600), and it and
    its folder are fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~umask)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
