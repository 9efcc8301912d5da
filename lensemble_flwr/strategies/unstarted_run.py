"""A start that fails before its first round takes back the run it began.

``LensembleStrategy.start`` writes its run (the manifest header, the initial checkpoint)
before it warms up, so that a run directory that cannot hold the run is refused before
any node is waited for. When the start then fails before a round opens (too few nodes
connected, an ``evaluate_fn(0)`` that raises), the run it wrote holds nothing worth
keeping, yet it would make the same start, run again once the cause is fixed, fail with
"already holds a run". :class:`RunDirBefore` notes what the folder was before the start,
and :meth:`RunDirBefore.restore` takes back what the start made: the store's folders
(``blobs/``, ``names/``, ``tmp/``) that were not there before, then the run directory
itself and the parents made for it, if the start made them and they are left empty.
Nothing else is removed: not a file another piece of code wrote into the folder
meanwhile, not a store folder that was there before.

Flower-free; standard library only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

STORE_FOLDERS = ("blobs", "names", "tmp")
"""What a run's store makes in its run directory (see :mod:`~lensemble_flwr.artifacts.store`)."""


@dataclasses.dataclass(frozen=True)
class RunDirBefore:
    """What a run directory was before a start wrote into it."""

    path: Path | None  # None: no run_dir given (the start makes a temporary one)
    missing: tuple[Path, ...]  # the folders from ``path`` up that did not exist
    present: frozenset[str]  # the store folders that were there already

    @classmethod
    def of(cls, run_dir: str | os.PathLike[str] | None) -> RunDirBefore:
        """Note what ``run_dir`` is now."""
        if run_dir is None:
            return cls(path=None, missing=(), present=frozenset())
        path = Path(run_dir)
        missing: list[Path] = []
        folder = path
        while not os.path.lexists(folder) and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        present = frozenset(n for n in STORE_FOLDERS if os.path.lexists(path / n))
        return cls(path=path, missing=tuple(missing), present=present)

    def restore(self, run_dir: Path) -> list[Path]:
        """Take back what the start made in ``run_dir`` (this folder, or the temporary one
        the start made): its store folders that were not there before, then the folders
        it made, each only if it is then empty. Never raises: what cannot be removed is
        logged and left. Returns what was removed."""
        if self.path is not None and Path(run_dir) != self.path:
            return []  # not the folder noted
        made = self.missing if self.path is not None else (Path(run_dir),)
        removed: list[Path] = []
        for name in STORE_FOLDERS:
            folder = Path(run_dir) / name
            if name in self.present or not folder.is_dir() or folder.is_symlink():
                continue
            try:
                shutil.rmtree(folder)
                removed.append(folder)
            except OSError as exc:
                log.warning("%s: not removed: %s", folder, exc)
        for folder in made:  # the run directory first, then the parents made for it
            try:
                folder.rmdir()  # only if empty
                removed.append(folder)
            except OSError:
                break
        return removed
