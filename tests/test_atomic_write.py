"""The atomic-write primitive: whole or nothing, the temp file never left behind, and the
fsyncs exactly when ``sync`` asks for them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lensemble_flwr import atomic_write
from lensemble_flwr.atomic_write import (
    discard,
    fill,
    fsync_folder,
    publish,
    user_file_mode,
    write_atomically,
    write_once,
)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What every ``os.fsync`` from now on synced: ``"folder"`` or ``"file"``."""
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return synced


@pytest.mark.parametrize("sync", [True, False])
def test_a_write_fsyncs_the_file_and_its_folder_only_when_asked(
    tmp_path: Path, fsyncs: list[str], sync: bool
) -> None:
    write_atomically(tmp_path / "f", b"one", sync=sync)
    write_atomically(tmp_path / "f", [b"tw", memoryview(b"o")], sync=sync)  # parts, in order
    assert (tmp_path / "f").read_bytes() == b"two"
    assert fsyncs == (["file", "folder"] * 2 if sync else [])
    assert _names(tmp_path) == ["f"]  # no temp file left


@pytest.mark.parametrize("sync", [True, False])
def test_write_once_fsyncs_only_when_asked_and_never_replaces(
    tmp_path: Path, fsyncs: list[str], sync: bool
) -> None:
    assert write_once(tmp_path / "f", b"first", sync=sync) is True
    assert fsyncs == (["file", "folder"] if sync else [])
    assert write_once(tmp_path / "f", b"second", sync=sync) is False
    assert (tmp_path / "f").read_bytes() == b"first"
    assert _names(tmp_path) == ["f"]


def test_a_write_that_fails_leaves_the_destination_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_bytes(b"old")

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the file's fsync fails, before the publish
    with pytest.raises(OSError, match="No space left"):
        write_atomically(tmp_path / "f", b"new", sync=True)
    with pytest.raises(OSError, match="No space left"):
        write_once(tmp_path / "g", b"new", sync=True)
    monkeypatch.undo()
    with pytest.raises(TypeError):  # a part that is no buffer: fails mid-write
        write_atomically(tmp_path / "f", [b"new", "text"], sync=False)  # type: ignore[list-item]
    assert (tmp_path / "f").read_bytes() == b"old"
    assert _names(tmp_path) == ["f"]


def test_a_publish_that_fails_removes_the_temp_file(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # neither os.replace nor os.link puts a file over a folder
    with pytest.raises(IsADirectoryError):
        write_atomically(tmp_path / "taken", b"data", sync=True)
    with pytest.raises(FileExistsError):
        write_once(tmp_path / "taken", b"data", sync=True)
    with pytest.raises(FileNotFoundError):  # no folder to write in: nothing is made
        write_atomically(tmp_path / "missing" / "f", b"data", sync=True)
    assert _names(tmp_path) == ["taken"] and _names(tmp_path / "taken") == []


def test_a_failing_folder_fsync_is_raised_after_the_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.fsync

    def folder_fails(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", folder_fails)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomically(tmp_path / "f", b"new", sync=True)
    assert (tmp_path / "f").read_bytes() == b"new"  # published, but maybe not durable
    assert _names(tmp_path) == ["f"]


def test_a_failing_chmod_closes_and_removes_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[int] = []
    real_close = os.close
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), real_close(fd))[1])

    def refused(_fd: int, _mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refused)
    with pytest.raises(PermissionError):
        write_atomically(tmp_path / "f", b"data", sync=False, mode=0o644)
    assert len(closed) == 1 and _names(tmp_path) == []


def test_the_mode_is_a_temp_files_unless_one_is_given(tmp_path: Path) -> None:
    write_atomically(tmp_path / "private", b"x", sync=False)
    write_atomically(tmp_path / "shared", b"x", sync=False, mode=0o644)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o644
    umask = os.umask(0o027)
    try:
        assert user_file_mode() == 0o640
        assert os.umask(umask) == 0o027  # the umask is left as it was
    finally:
        os.umask(umask)


def test_the_steps_for_a_caller_with_its_own_temp_file(tmp_path: Path, fsyncs: list[str]) -> None:
    (tmp_path / "tmp").mkdir()
    fd = os.open(tmp_path / "tmp" / "t", os.O_CREAT | os.O_WRONLY, 0o600)
    fill(fd, [b"a" * 10, b"b"], sync=True)
    with pytest.raises(OSError):
        os.fstat(fd)  # fill closed it
    assert publish(tmp_path / "tmp" / "t", tmp_path / "dest", sync=False, once=True) is True
    assert publish(tmp_path / "tmp" / "t", tmp_path / "dest", sync=True, once=True) is False
    assert fsyncs == ["file"]  # no folder fsync: the first publish did not sync, the second
    discard(tmp_path / "tmp" / "t")  # published nothing
    discard(tmp_path / "tmp" / "t")  # already gone: nothing to do
    assert (tmp_path / "dest").read_bytes() == b"a" * 10 + b"b"
    assert _names(tmp_path / "tmp") == []
    fsync_folder(tmp_path)
    assert fsyncs[-1] == "folder"


def test_a_large_buffer_is_written_in_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic_write, "_SLICE", 7)
    data = bytes(range(256)) * 3
    write_atomically(tmp_path / "f", data, sync=False)
    assert (tmp_path / "f").read_bytes() == data
