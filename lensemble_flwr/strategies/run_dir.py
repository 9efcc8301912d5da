"""Where a strategy's run goes, and taking back a run that never reached round 1.

:class:`RunPlace` is a strategy's run directory and the coordinator that runs in it: it
opens a new run there (or resumes the one it holds) and refuses a folder that holds a run
already. ``LensembleStrategy.start`` writes its run (the manifest header, the initial
checkpoint) before it warms up, so that a run directory that cannot hold the run is
refused before any node is waited for. When the start then fails before a round opens
(too few nodes connected, an ``evaluate_fn(0)`` that raises), the run it wrote holds
nothing worth keeping, yet it would make the same start, run again once the cause is
fixed, fail with "already holds a run". :meth:`RunPlace.undone_if_it_fails` notes what
the folder was before (:class:`RunDirBefore`) and, on a failure, takes back what the
start made: the store's folders (``blobs/``, ``names/``, ``tmp/``) that were not there
before, then the run directory itself and the parents made for it, if the start made
them and they are left empty. Nothing else is removed: not a file another piece of code
wrote into the folder meanwhile, not a store folder that was there before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from logging import INFO
from pathlib import Path

from flwr.app import ArrayRecord
from flwr.common import log as say

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator, holds_a_run
from lensemble_flwr.errors import StoreError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.strategies.layout import ArrayLayout
from lensemble_flwr.transports.base import Transport

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


@dataclasses.dataclass
class RunPlace:
    """A strategy's run directory (None until a run makes a temporary one) and the
    coordinator of the run in it (None until a run opens)."""

    path: Path | None
    coordinator: Coordinator | None = None

    def open(
        self,
        config: LensembleConfig,
        initial_arrays: ArrayRecord,
        *,
        run_id: str,
        sync: bool,
        transport: Transport,
        gauge: GaugeSetup | None,
        identities: Mapping[str, str] | None,
        resume: bool,
    ) -> Coordinator:
        """Open a new run here (a fresh temporary directory if no path was given), or with
        ``resume`` continue the run the directory holds.

        Raises:
            StoreError: the directory holds a run already, and ``resume`` is not asked for
                (or the run has no manifest to resume from).
        """
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix="lensemble-run-"))
        store = Store(self.path, sync=sync)
        common = {"transport": transport, "store": store, "gauge": gauge, "identities": identities}
        if resume and store.bound("manifest"):
            self.coordinator = Coordinator.resume(config, **common)
            log.info("resumed at round %d", self.coordinator.global_state().next_round)
        else:
            if holds_a_run(store):  # said in the strategy's terms, not Coordinator's
                how = (
                    "it has no run manifest, so it cannot be resumed"
                    if resume
                    else "or resume=True to continue that run"
                )
                raise StoreError(
                    f"{self.path} already holds a run: give the strategy a fresh "
                    f"run_dir (or none: a new temporary one); {how}"
                )
            self.coordinator = Coordinator(
                config,
                initial_params=ArrayLayout.split(initial_arrays)[1],
                run_id=run_id,
                **common,
            )
        say(INFO, "\t├── run directory: %s", self.path)
        return self.coordinator

    @contextlib.contextmanager
    def undone_if_it_fails(self) -> Iterator[None]:
        """Steps before a run's first round: if one raises, the run they began is taken
        back (the store's folders it made, and the run directory if it made it), so that
        the same start can run once the cause is fixed. A run directory that held a run
        before is left as it is."""
        before = RunDirBefore.of(self.path)
        try:
            yield
        except BaseException:
            run_dir = self.path
            if run_dir is not None and "names" not in before.present:
                if self.coordinator is not None:
                    self.coordinator.store.close()
                removed = before.restore(run_dir)
                if not (run_dir / "names").exists():  # the run is gone
                    log.info(
                        "the run did not reach its first round: removed %s",
                        ", ".join(str(path) for path in removed) or "nothing",
                    )
                    self.coordinator = None
                    if before.path is None and not run_dir.exists():
                        self.path = None
            raise
