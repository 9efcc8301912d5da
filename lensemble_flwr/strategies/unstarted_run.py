"""A start that fails before its first round leaves the run directory as it found it.

``LensembleStrategy.start`` writes its run (the manifest header, the initial checkpoint)
before it warms up, so that a run directory that cannot hold the run is refused before
any node is waited for. When the start then fails before a round opens (too few nodes
connected, a DP plan that does not fit, an ``evaluate_fn(0)`` that raises), the run it
wrote holds nothing worth keeping, yet it would make the same start, run again once the
cause is fixed, fail with "already holds a run". :class:`RunDirBefore` notes what the
folder was before the start, and :meth:`RunDirBefore.restore` puts it back: a folder the
start made (a temporary one, or a ``run_dir`` that did not exist) is removed, one that
was empty is emptied. A folder that held anything is never touched.

Flower-free; standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunDirBefore:
    """What a run directory was before a start wrote into it."""

    path: Path | None  # None: no run_dir given (the start makes a temporary one)
    existed: bool
    empty: bool

    @classmethod
    def of(cls, run_dir: str | os.PathLike[str] | None) -> RunDirBefore:
        """Note what ``run_dir`` is now (a folder that cannot be listed counts as used:
        building the run's store then says what is wrong with it)."""
        if run_dir is None:
            return cls(path=None, existed=False, empty=True)
        path = Path(run_dir)
        try:
            with os.scandir(path) as entries:
                empty = next(entries, None) is None
        except FileNotFoundError:
            return cls(path=path, existed=False, empty=True)
        except OSError:
            return cls(path=path, existed=True, empty=False)
        return cls(path=path, existed=True, empty=empty)

    @property
    def unused(self) -> bool:
        """Whether the start made the folder or found it empty (then it may restore it)."""
        return not self.existed or self.empty

    def restore(self, run_dir: Path) -> bool:
        """Put ``run_dir`` (where the start wrote its run: this folder, or the temporary
        one it made) back as it was: removed if the start made it, emptied if it was
        empty. A removal that fails half-way is left as it is. Returns whether the folder
        was restored (False for a folder that held something: it is not touched).
        """
        if not self.unused or (self.path is not None and Path(run_dir) != self.path):
            return False
        if not self.existed:
            shutil.rmtree(run_dir, ignore_errors=True)
            return not Path(run_dir).exists()
        with os.scandir(run_dir) as entries:
            children = [Path(entry.path) for entry in entries]
        for child in children:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        return not any(Path(run_dir).iterdir())
