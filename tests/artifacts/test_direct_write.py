"""A large durable blob is written around the page cache (``O_DIRECT``), with the same
bytes and digest as a write through it; where direct I/O is refused the store writes as
before; a failed direct write publishes nothing and leaves no temp file."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

import lensemble_flwr.artifacts.direct_write as direct_module
import lensemble_flwr.artifacts.store as store_module
from lensemble_flwr.artifacts.direct_write import ALIGNMENT, write_direct
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import StoreError

needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _parts(sizes: list[int], seed: int = 0) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]


def _direct_here(path: Path) -> bool:
    """Whether the filesystem of ``path`` takes direct writes (a tmpfs may not)."""
    probe = path / "probe"
    probe.touch()
    try:
        return write_direct(str(probe), [memoryview(b"x")])
    finally:
        probe.unlink()


@pytest.fixture
def small_buffer(monkeypatch: pytest.MonkeyPatch) -> int:
    """A 3-block buffer and no size threshold: every durable put_parts goes direct, and
    the parts below span several buffers."""
    monkeypatch.setattr(direct_module, "BUFFER_BYTES", 3 * ALIGNMENT)
    monkeypatch.setattr(store_module, "DIRECT_WRITE_MIN_BYTES", 0)
    return 3 * ALIGNMENT


@pytest.fixture
def returned(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each call of ``write_direct`` by the store returned (True: written direct)."""
    calls: list[bool] = []
    real = store_module.write_direct

    def recorded(path: str, parts: list[memoryview]) -> bool:
        calls.append(real(path, parts))
        return calls[-1]

    monkeypatch.setattr(store_module, "write_direct", recorded)
    return calls


@needs_o_direct
@pytest.mark.parametrize(
    "sizes",
    [
        [1],
        [ALIGNMENT],
        [ALIGNMENT - 1, 1],
        [17, 3 * ALIGNMENT, 5],  # a header, then a part that fills the buffer exactly
        [100, 7 * ALIGNMENT + 123, 0, 2 * ALIGNMENT],
        [3 * ALIGNMENT],  # exactly one buffer: no partial block at the end
        [2 * ALIGNMENT, 4 * ALIGNMENT],  # exactly two buffers
        [],
    ],
)
def test_a_direct_write_holds_exactly_the_bytes(
    tmp_path: Path, small_buffer: int, sizes: list[int]
) -> None:
    if not _direct_here(tmp_path):
        pytest.skip("this filesystem refuses direct I/O")
    parts = _parts(sizes)
    path = tmp_path / "file"
    path.touch()
    assert write_direct(str(path), parts)
    assert path.read_bytes() == b"".join(parts)  # no padding left at the end


@needs_o_direct
def test_a_durable_large_blob_is_written_direct_with_the_same_digest(
    tmp_path: Path, small_buffer: int, returned: list[bool]
) -> None:
    if not _direct_here(tmp_path):
        pytest.skip("this filesystem refuses direct I/O")
    parts = _parts([40, 5 * ALIGNMENT + 7, 2 * ALIGNMENT])
    direct = Store(tmp_path / "direct", sync=True).put_parts(parts)
    assert returned == [True]  # written direct, not by the fallback
    assert direct == hashlib.sha256(b"".join(parts)).hexdigest()
    blob = tmp_path / "direct" / "blobs" / direct[:2] / direct
    assert blob.read_bytes() == b"".join(parts)
    assert not any((tmp_path / "direct" / "tmp").iterdir())


def test_a_store_that_does_not_sync_or_a_small_blob_is_written_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: str, parts: list[memoryview]) -> bool:
        raise AssertionError("written direct")

    monkeypatch.setattr(store_module, "write_direct", refuse)
    parts = [b"small ", memoryview(b"durable blob")]
    assert Store(tmp_path / "a", sync=True).put_parts(parts)  # under the threshold
    monkeypatch.setattr(store_module, "DIRECT_WRITE_MIN_BYTES", 0)
    assert Store(tmp_path / "b", sync=False).put_parts(parts)  # not durable: the cache


@pytest.mark.parametrize("refused_at", ["open", "write", "a later write"])
def test_direct_io_refused_falls_back_to_the_page_cache(
    tmp_path: Path,
    small_buffer: int,
    returned: list[bool],
    monkeypatch: pytest.MonkeyPatch,
    refused_at: str,
) -> None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        monkeypatch.setattr(os, "O_DIRECT", 0o40000, raising=False)
        flag = os.O_DIRECT
    real_open, real_write = os.open, os.write
    direct_fds: set[int] = set()

    def open_(path: str, flags: int, *args: int) -> int:
        if flags & flag:
            if refused_at == "open":
                raise OSError(errno.EINVAL, "Invalid argument")
            fd = real_open(path, flags & ~flag, *args)  # a plain open standing in for it
            direct_fds.add(fd)
            return fd
        return real_open(path, flags, *args)

    def write(fd: int, data: bytes) -> int:
        first = os.lseek(fd, 0, os.SEEK_CUR) == 0
        if fd in direct_fds and (refused_at == "write" or not first):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_module.os, "open", open_)
    monkeypatch.setattr(direct_module.os, "write", write)
    path = tmp_path / "file"
    path.touch()
    parts = _parts([10, 4 * ALIGNMENT])
    assert write_direct(str(path), parts) is False
    assert path.stat().st_size == 0  # nothing left: the caller writes it another way
    digest = Store(tmp_path / "run", sync=True).put_parts(parts)
    assert returned == [False]  # tried, refused, then written through the cache
    assert Store(tmp_path / "run").get(digest) == b"".join(parts)


def test_a_direct_write_that_fails_publishes_nothing(
    tmp_path: Path, small_buffer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "O_DIRECT") or not _direct_here(tmp_path):
        pytest.skip("no direct I/O here")
    real_write = os.write
    writes = {"n": 0}

    def full_disk(fd: int, data: memoryview) -> int:  # the second block finds the disk full
        writes["n"] += 1
        if writes["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(direct_module.os, "write", full_disk)
    store = Store(tmp_path / "run", sync=True)
    with pytest.raises(StoreError, match="No space left on device"):
        store.put_parts(_parts([10, 4 * ALIGNMENT]))
    assert writes["n"] == 2  # the real direct write ran, and failed part-way
    assert not any((tmp_path / "run" / "tmp").iterdir())
    assert not [p for p in (tmp_path / "run" / "blobs").rglob("*") if p.is_file()]


def test_write_direct_takes_any_bytes_like_parts(tmp_path: Path, small_buffer: int) -> None:
    if not hasattr(os, "O_DIRECT") or not _direct_here(tmp_path):
        pytest.skip("no direct I/O here")
    values = np.arange(3000, dtype=np.float32).reshape(30, 100)
    path = tmp_path / "file"
    path.touch()
    assert write_direct(str(path), [b"head", memoryview(values), values[::2].tobytes()])
    assert path.read_bytes() == b"head" + values.tobytes() + values[::2].tobytes()


@needs_o_direct
def test_a_short_unaligned_direct_write_is_an_error(
    tmp_path: Path, small_buffer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_here(tmp_path):
        pytest.skip("this filesystem refuses direct I/O")
    real_write = os.write

    def short(fd: int, data: memoryview) -> int:  # the first block whole, then 100 bytes
        return real_write(fd, data) if os.lseek(fd, 0, os.SEEK_CUR) == 0 else 100

    monkeypatch.setattr(direct_module.os, "write", short)
    path = tmp_path / "file"
    path.touch()
    with pytest.raises(OSError, match="short direct write"):
        write_direct(str(path), _parts([5 * ALIGNMENT]))
