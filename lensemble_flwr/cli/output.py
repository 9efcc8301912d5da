"""What every ``lensemble-flwr`` command shares: exit codes, the usage error, consoles, output
files."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from lensemble_flwr.atomic_write import user_file_mode, write_atomically

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


def write_output(path: Path, data: bytes) -> None:
    """Write a command's output file ``path`` whole or not at all
    (:func:`lensemble_flwr.atomic_write.write_atomically`, fsynced), making its folder if
    needed. The file gets the mode any new file of the user gets (the umask's, not a temp
    file's 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data, sync=True, mode=user_file_mode())
