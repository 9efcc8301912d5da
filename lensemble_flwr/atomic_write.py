"""Writing a file whole or not at all: the package's one atomic-write primitive.

Every file the package writes under a name a reader may open goes the same way:

1. into a temp file (in the destination's folder, or one the caller made on the same
   filesystem, such as a store's ``tmp/``),
2. the temp file is flushed and, when ``sync``, fsynced,
3. published in one step: ``os.replace`` (the name now holds the new bytes), or
   ``os.link`` for a write that must not replace anything (a claim: the first writer wins),
4. when ``sync``, the destination's folder is fsynced, so the new name survives a power
   loss too,
5. on any error, the temp file is removed and the error raised: the destination is as it
   was.

``sync`` is always the caller's explicit choice. Without it a write is published as
atomically (a killed *process* never leaves part of it under the name), but a power loss
or a kernel crash may lose it, or leave it empty.

:func:`write_atomically` and :func:`write_once` do all five steps; :func:`fill` and
:func:`publish` are steps 2 and 3-4 for a caller that brings its own temp file
(:class:`lensemble_flwr.artifacts.store.Store` takes prepared ones, and writes large blobs
with ``O_DIRECT``). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "discard",
    "fill",
    "fsync_folder",
    "publish",
    "user_file_mode",
    "write_atomically",
    "write_once",
]

Data = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]
"""What a write takes: one buffer, or parts written one after the other."""

_SLICE = 1 << 24
"""Bytes per ``os.write`` call (16 MiB): a larger view is written in slices."""


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Fsync ``folder`` itself, so the names made or removed in it survive a power loss.

    Raises:
        OSError: the folder cannot be opened or fsynced.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def user_file_mode() -> int:
    """The mode a new file of this process gets (``0o666`` less the umask), for a file the
    user reads and shares, where a temp file's own ``0o600`` would be a surprise."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def fill(fd: int, data: Data, *, sync: bool) -> None:
    """Write all of ``data`` into the open, empty temp file ``fd``, then close it; fsync it
    first when ``sync``. The descriptor is closed on every path.

    Raises:
        OSError: a write or the fsync failed (the file may hold part of ``data``).
    """
    parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    with os.fdopen(fd, "wb", buffering=0) as f:
        for part in parts:
            view = memoryview(part).cast("B")
            for lo in range(0, len(view), _SLICE):
                chunk = view[lo : lo + _SLICE]
                while chunk:
                    chunk = chunk[f.write(chunk) :]
        if sync:
            os.fsync(f.fileno())


def publish(
    temp: str | os.PathLike[str], dest: str | os.PathLike[str], *, sync: bool, once: bool = False
) -> bool:
    """Publish the written temp file ``temp`` at ``dest`` in one step, then fsync ``dest``'s
    folder when ``sync``. ``temp`` is left where it is (after ``os.replace`` it is gone;
    after ``os.link`` the caller removes it: see :func:`discard`).

    Args:
        temp: the temp file, on the same filesystem as ``dest``.
        dest: the name to publish under.
        sync: fsync ``dest``'s folder once the name is there.
        once: publish only if ``dest`` does not exist (``os.link``: the first writer wins)
            instead of replacing it (``os.replace``).

    Returns:
        False only when ``once`` and ``dest`` already exists (nothing was published);
        True otherwise.

    Raises:
        OSError: the publish or the folder's fsync failed; ``dest`` is a folder
            (IsADirectoryError, or FileExistsError when ``once``).
    """
    if not once:
        os.replace(temp, dest)
    else:
        try:
            os.link(temp, dest)
        except FileExistsError:
            if os.path.isdir(dest):
                raise
            return False
    if sync:
        fsync_folder(Path(dest).parent)
    return True


def discard(temp: str | os.PathLike[str]) -> None:
    """Remove the temp file ``temp`` if it is still there (after a failed or a linked write)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)


def _write(path: Path, data: Data, *, sync: bool, mode: int | None, once: bool) -> bool:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if mode is not None:
            try:
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)  # fill, which closes it, is never reached
                raise
        fill(fd, data, sync=sync)
        return publish(temp, path, sync=sync, once=once)
    finally:
        discard(temp)


def write_atomically(
    path: str | os.PathLike[str], data: Data, *, sync: bool, mode: int | None = None
) -> None:
    """Replace ``path``'s contents with ``data``, whole or not at all (see the module's
    docstring): ``path`` holds the old bytes or the new ones, never part of either, and no
    temp file is left behind.

    Args:
        path: the file to write; its folder must exist.
        data: the bytes, or parts written one after the other.
        sync: fsync the file and its folder (durable across a power loss).
        mode: the file's permission bits; None keeps a temp file's ``0o600`` (owner only).

    Raises:
        OSError: nothing was published (the folder is missing or read-only, the disk is
            full, ``path`` is a folder), or the folder's fsync failed after the publish.
    """
    _write(Path(path), data, sync=sync, mode=mode, once=False)


def write_once(
    path: str | os.PathLike[str], data: Data, *, sync: bool, mode: int | None = None
) -> bool:
    """Create ``path`` holding ``data``, whole, only if nothing is there yet: of writers
    racing for the same name exactly one wins and the file is never replaced.

    Returns:
        True if this call created ``path``; False if it already existed (left as it was).

    Raises:
        OSError: as for :func:`write_atomically`.
    """
    return _write(Path(path), data, sync=sync, mode=mode, once=True)
